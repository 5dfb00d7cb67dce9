"""``python -m rlhpc.engine_server.cpu --model-path DIR [--port 0 --ready-file FILE ...]``."""

from rlhpc.engine_server.cpu.server import main

if __name__ == "__main__":
    main()
