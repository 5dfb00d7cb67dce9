"""``python -m rlhpc.rollout.cpu_server --model-path DIR [--port 0 --ready-file FILE ...]``."""

from rlhpc.rollout.cpu_server.server import main

if __name__ == "__main__":
    main()
