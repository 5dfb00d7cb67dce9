"""What runs in an engine's own processes: the Ray actor that hosts one engine on its node
(``host``), the CPU engine server (``cpu``), SGLang's and sglang_router's command lines
(``sglang``, ``router_main``). The driver reaches them only over HTTP (``rlhpc.wire``)."""
