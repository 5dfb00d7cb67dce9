"""The weight channel, trainer to engines. It runs inside actor rank 0 (the senders), the engine
(the receiving end of the update group, the tensor transport's loader) and the driver's pool (the
``WeightSource`` it calls). Over SGLang's own weight-update routes (``rlhpc.wire``)."""
