"""``python -m posttrain.local_engine --model-path DIR [--host H] [--port P] ...``."""

from posttrain.local_engine._server import main

if __name__ == "__main__":
    main()
