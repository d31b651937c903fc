"""`rl-tpu` command line. Each subcommand imports what it needs only when it runs, so `--help` and
config errors answer in well under a second.

Subcommands: make-tiny-model, config show, generate, train, sft, plot, demo, estimate, doctor.
A mistake in the user's input (`rl_tpu.errors.UserError`: config, data file, reward spec, model folder,
a damaged `--resume` checkpoint or one of another model size) exits with status 2 and one line naming the
culprit; `--verbose` adds the traceback. Anything else is our bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from pathlib import Path

from rl_tpu.config import DEFAULT_CONFIG, ConfigError, load_config, to_toml
from rl_tpu.errors import UserError


def _split_overrides(extra: list[str]) -> list[str]:
    bad = [x for x in extra if not x.startswith("--") or "=" not in x]
    if bad:
        raise ConfigError(
            f"config error: unrecognised argument(s) {bad}; overrides look like --section.key=value"
        )
    return extra


def _load(args: argparse.Namespace, extra: list[str]):
    path = args.config if args.config is not None else DEFAULT_CONFIG
    return load_config(path, _split_overrides(extra))


def cmd_make_tiny_model(args: argparse.Namespace, extra: list[str]) -> int:
    from rl_tpu.tiny_model import make_tiny_model

    if extra:
        raise ConfigError(f"make-tiny-model: unrecognised argument(s) {extra}")
    out = make_tiny_model(
        args.out, arch=args.arch, size=args.size, seed=args.seed, tie_embeddings=args.tie_embeddings
    )
    print(f"wrote {out}")
    return 0


def cmd_config_show(args: argparse.Namespace, extra: list[str]) -> int:
    print(to_toml(_load(args, extra)), end="")
    return 0


def cmd_generate(args: argparse.Namespace, extra: list[str]) -> int:
    from rl_tpu.model_folder import check_model_folder
    from rl_tpu.model_source import resolve_model_path
    from rl_tpu.rollout.engine import generate_text
    from rl_tpu.tiny_model import make_tiny_model

    cfg = _load(args, extra)
    args.verbose = cfg.logging.verbose or args.verbose
    model_path = resolve_model_path(cfg.model.path)
    if model_path:  # vLLM serves more architectures than the trainer builds: vLLM's are checked
        check_model_folder(model_path, trainer=False, engine=True)
    else:
        model_path = str(
            make_tiny_model(
                Path(cfg.logging.run_dir) / "model",
                cfg.model.arch,
                cfg.model.size,
                cfg.model.seed,
                cfg.model.tie_embeddings,
            )
        )
    prompts = args.prompt or ["What is 12+30?", "What is 7+5?"]
    lora = str(args.lora) if args.lora else None  # a bad folder: a ConfigError before the engine starts
    for prompt, c in zip(prompts, generate_text(model_path, prompts, cfg, lora=lora)):
        print(f"{prompt!r} -> {c.text!r} ({len(c.response_ids)} tokens, {c.finish_reason})")
    return 0


def cmd_train(args: argparse.Namespace, extra: list[str]) -> int:
    from rl_tpu.controller.loop import train

    cfg = _load(args, extra)
    if args.address is not None:
        cfg.cluster.address = args.address
    if args.resume is not None:
        cfg.checkpoint.resume = args.resume
    cfg.logging.verbose = args.verbose = cfg.logging.verbose or args.verbose
    out = train(cfg)
    final = out["final"]
    shown = {
        k: final[k]
        for k in ("reward/mean", "eval/accuracy", "loss/policy", "mismatch/kl", "time/step")
        if k in final
    }
    print(f"trained {out['steps']} steps; last step: " + ", ".join(f"{k} {v:.4g}" for k, v in shown.items()))
    print(f"metrics: {out['run_dir']}/metrics.jsonl   policy (HF folder): {out['hf']}")
    return 0


def cmd_sft(args: argparse.Namespace, extra: list[str]) -> int:
    from rl_tpu.controller.sft import run_sft

    cfg = _load(args, extra)
    cfg.logging.verbose = args.verbose = cfg.logging.verbose or args.verbose
    out = run_sft(cfg)
    print(f"wrote {out['hf']}")
    return 0


def cmd_demo(args: argparse.Namespace, extra: list[str]) -> int:
    from rl_tpu.commands.demo import run_demo

    if extra:
        raise ConfigError(f"demo: unrecognised argument(s) {extra}")
    if args.model is not None:
        from rl_tpu.commands.demo_model import run_model_demo

        if args.task != "addition":
            raise ConfigError("demo: --model runs its own task; leave out --task")
        run_model_demo(
            args.model, out=args.out or Path("runs/demo-model"), quick=args.quick, verbose=args.verbose
        )
        return 0
    if args.task == "tools":
        from rl_tpu.commands.demo_tools import run_tools_demo

        run_tools_demo(out=args.out or Path("runs/demo-tools"), quick=args.quick, verbose=args.verbose)
        return 0
    run_demo(out=args.out or Path("runs/demo"), quick=args.quick, verbose=args.verbose)
    return 0


def cmd_plot(args: argparse.Namespace, extra: list[str]) -> int:
    from rl_tpu.commands.plot import plot_run

    if extra:
        raise ConfigError(f"plot: unrecognised argument(s) {extra}")
    print(f"wrote {plot_run(args.run_dir, args.out)}")
    return 0


def cmd_doctor(args: argparse.Namespace, extra: list[str]) -> int:
    from rl_tpu.devices.doctor import doctor, format_lines, to_json

    if extra:
        raise ConfigError(f"doctor: unrecognised argument(s) {extra}")
    verdicts = doctor(args.env)
    print(to_json(verdicts) if args.json else "\n".join(format_lines(verdicts)))
    return 0


def cmd_estimate(args: argparse.Namespace, extra: list[str]) -> int:
    from rl_tpu.commands.estimate import run

    run(args.config, _split_overrides(extra), args.hardware, args.bandwidth_gbps)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rl-tpu", description="RL post-training: TorchTitan trainer, vLLM rollouts, Ray."
    )
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("make-tiny-model", help="write a tiny Hugging Face model folder built locally")
    s.add_argument("out")
    s.add_argument("--arch", choices=["qwen3", "llama", "qwen3_moe"], default="qwen3")
    s.add_argument("--size", choices=["tiny", "mini", "small", "medium"], default="tiny")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument(
        "--tie-embeddings", action="store_true", help="one tensor for input embedding and output head"
    )
    s.set_defaults(fn=cmd_make_tiny_model)

    s = sub.add_parser("config", help="inspect configs")
    csub = s.add_subparsers(dest="config_command", required=True)
    c = csub.add_parser("show", help="print the resolved config (file + overrides) as TOML")
    c.add_argument("config", nargs="?", type=Path, help=f"TOML file (default: {DEFAULT_CONFIG.name})")
    c.set_defaults(fn=cmd_config_show)

    s = sub.add_parser("generate", help="sample completions from a model with vLLM")
    s.add_argument("config", nargs="?", type=Path)
    s.add_argument("--prompt", action="append", help="a user message (repeatable)")
    s.add_argument(
        "--lora", type=Path, help="a PEFT adapter folder served over --model.path (rl-tpu sft's RUN/adapter)"
    )
    s.add_argument("--verbose", action="store_true", help="show the traceback of an input error")
    s.set_defaults(fn=cmd_generate)

    s = sub.add_parser("train", help="run GRPO/PPO from a config")
    s.add_argument("config", nargs="?", type=Path)
    s.add_argument("--address", help="Ray cluster address (default: start a local Ray)")
    s.add_argument("--resume", help="'auto' or a checkpoint folder")
    s.add_argument("--verbose", action="store_true", help="show Ray's, vLLM's and the actors' logs")
    s.set_defaults(fn=cmd_train)

    s = sub.add_parser("sft", help="supervised fine-tuning on demonstrations with the same trainer")
    s.add_argument("config", nargs="?", type=Path)
    s.add_argument("--verbose", action="store_true", help="show Ray's, vLLM's and the actors' logs")
    s.set_defaults(fn=cmd_sft)

    s = sub.add_parser("plot", help="write PNG curves of a run's metrics.jsonl")
    s.add_argument("run_dir", type=Path)
    s.add_argument("--out", type=Path, help="PNG path (default: RUN_DIR/metrics.png)")
    s.set_defaults(fn=cmd_plot)

    s = sub.add_parser("demo", help="the CPU demo: build a model, train it, report")
    s.add_argument(
        "--task",
        choices=("addition", "tools"),
        default="addition",
        help="addition: 2-digit addition (default); tools: 3-digit multiplication with a calculator tool",
    )
    s.add_argument(
        "--model",
        help="GRPO on a real pretrained model instead (smollm2-135m-instruct, a folder, a Hub id, a GGUF "
        "file), against the model as shipped and rejection-sampling fine-tuning for the same time",
    )
    s.add_argument(
        "--out", type=Path, help="output folder (default: runs/demo, runs/demo-tools, runs/demo-model)"
    )
    s.add_argument("--quick", action="store_true", help="a shortened run (for tests)")
    s.add_argument("--verbose", action="store_true", help="show Ray's, vLLM's and the actors' logs")
    s.set_defaults(fn=cmd_demo)

    s = sub.add_parser(
        "estimate", help="per-device memory, weight-sync bytes and time of a recipe, and whether it fits"
    )
    s.add_argument("config", nargs="?", type=Path, help="recipe TOML (examples/recipes/)")
    s.add_argument("--hardware", help="v5p, v6e, h100 or host (default: from the recipe's file name)")
    s.add_argument("--bandwidth-gbps", type=float, default=10.0, help="GB/s per sync link (default 10)")
    s.set_defaults(fn=cmd_estimate)

    s = sub.add_parser("doctor", help="which device rows and role environments are usable here, and why not")
    s.add_argument(
        "--json", action="store_true", help='one JSON object: name -> {"usable": bool, "reason": str}'
    )
    s.add_argument(
        "--env",
        action="append",
        default=[],
        help="a role environment (folder or interpreter) to examine besides ./.venv-* (repeatable)",
    )
    s.set_defaults(fn=cmd_doctor)
    return p


def _is_override(arg: str) -> bool:
    return arg.startswith("--") and "=" in arg and "." in arg.split("=", 1)[0]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # overrides bypass argparse: it takes "--x={a = 1}" (a value with spaces) for a positional argument
    overrides = [a for a in argv if _is_override(a)]
    args, extra = build_parser().parse_known_args([a for a in argv if not _is_override(a)])
    extra = overrides + extra
    _console_log()
    try:
        return args.fn(args, extra)
    except Exception as e:  # noqa: BLE001 - re-raised unless it is the user's mistake
        # FileNotFoundError: checkpoint.resume and `plot`'s run folder still raise it for a missing path
        user = e if isinstance(e, FileNotFoundError) else user_error(e)
        if user is None:
            raise
        if getattr(args, "verbose", False):
            traceback.print_exc()
        print(f"rl-tpu: {one_line(str(user))}", file=sys.stderr)
        return 2


def _console_log() -> None:
    """Our own log lines (an engine restarted, a damaged checkpoint skipped, resumed at step N, ready after
    N s) go to stderr; without a handler Python would show warnings only and drop the rest."""
    log = logging.getLogger("rl_tpu")
    mine = [h for h in log.handlers if getattr(h, "_rl_tpu_console", False)]
    if mine:  # a later call in the same process (tests, a notebook) writes to today's stderr
        mine[0].stream = sys.stderr  # not setStream: it flushes the old one, which may be closed
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("rl-tpu: %(message)s"))
        handler._rl_tpu_console = True  # type: ignore[attr-defined]
        log.addHandler(handler)
    log.setLevel(logging.INFO)


def user_error(e: BaseException) -> UserError | None:
    """The user's mistake behind `e`, or None (our bug). Follows explicit wrapping (a Ray task error's
    or a trainer rank error's `cause`, `raise ... from`) down to the innermost `UserError`: Ray's
    wrapper of a remote DataError is itself a DataError, but its text is the whole remote traceback."""
    found, seen = None, set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, UserError):
            found = e
        cause = getattr(e, "cause", None)
        e = cause if isinstance(cause, BaseException) else e.__cause__
    return found


def one_line(message: str) -> str:
    """Messages that quote another error (a user module's ImportError, a tokenizer's) can span lines."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


if __name__ == "__main__":
    sys.exit(main())
