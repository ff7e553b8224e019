"""The `tritonllm` command: prepare-model, serve, worker, quantize, bench."""

from __future__ import annotations

import argparse
import sys
from dataclasses import MISSING, fields

from backend.config import EngineConfig, cast_value


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each option's help ends with its default, unless the help states it already or there is
    none to state (None, False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if ("default" in help_text or action.default in (None, False, argparse.SUPPRESS)
                or not action.option_strings):
            return help_text
        return f"{help_text} (default: %(default)s)"


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, named as the field with dashes (vLLM's serve flags). The
    parser's default stays None (a flag not given is not written to model.json); the help shows
    EngineConfig's."""
    group = parser.add_argument_group("engine")
    for f in fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        if f.default is not MISSING and f.default is not None and "default" not in help_text:
            help_text = f"{help_text} (default: {f.default})"
        if f.type.startswith("bool"):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            group.add_argument(flag, default=None, metavar=f.name.upper(), help=help_text,
                               nargs=f.metadata.get("nargs"))


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine config from the flags actually given (others keep EngineConfig's defaults)."""
    return EngineConfig.from_dict(engine_args_from_namespace(args))


def engine_args_from_namespace(args: argparse.Namespace) -> dict:
    values = {}
    for f in fields(EngineConfig):
        value = getattr(args, f.name, None)
        if value is not None:
            values[f.name] = cast_value(f.name, f.type, value)
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tritonllm", description=__doc__, formatter_class=HelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    prepare = commands.add_parser("prepare-model", formatter_class=HelpFormatter, help="fetch and convert the default model (SmolLM2-135M-Instruct)")
    prepare.add_argument("--force", action="store_true", help="convert again even if cached")

    serve = commands.add_parser("serve", help="start Triton with the llm model and the OpenAI frontend",
                                formatter_class=HelpFormatter)
    try:
        from tools.serve import add_serve_arguments
        add_serve_arguments(serve)
    except ImportError:
        serve.set_defaults(serve_missing=True)
    add_engine_arguments(serve)

    worker = commands.add_parser("worker", formatter_class=HelpFormatter, help="run this host's tensor/pipeline-parallel ranks (multi-node)")
    from tools.worker import add_arguments as add_worker_arguments
    add_worker_arguments(worker)
    add_engine_arguments(worker)

    quantize = commands.add_parser("quantize", help="write an AWQ or GPTQ checkpoint of a float model",
                                   description=__import__("tools.quantize").quantize.__doc__,
                                   formatter_class=HelpFormatter)
    from tools.quantize import add_arguments as add_quantize_arguments
    add_quantize_arguments(quantize)

    import tools.bench
    from tools.bench.cli import add_arguments as add_bench_arguments
    bench = commands.add_parser("bench", help="throughput and latency against the baselines, in one run",
                                description=tools.bench.__doc__, formatter_class=HelpFormatter)
    add_bench_arguments(bench)

    args = parser.parse_args(argv)
    if args.command == "prepare-model":
        from tools.prepare_model import prepare_model
        print(prepare_model(force=args.force))
        return 0
    if args.command == "serve":
        from tools.serve import run_serve
        return run_serve(args)
    if args.command == "worker":
        from tools.worker import run_worker
        try:
            config = engine_config_from_args(args)
        except ValueError as error:
            print(f"tritonllm worker: {error}", file=sys.stderr)
            return 2
        return run_worker(config)
    if args.command == "quantize":
        from tools.quantize import run as run_quantize
        return run_quantize(args)
    if args.command == "bench":
        from tools.bench.cli import run as run_bench
        return run_bench(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
