"""The weight channel, trainer to engines. It runs inside actor rank 0 (the senders) and the engine
(the receiving end of the update group, the tensor transport's loader); the driver's
``rlhpc.rollout.weight_sync`` says when. Over SGLang's own weight-update routes (``rlhpc.wire``)."""
