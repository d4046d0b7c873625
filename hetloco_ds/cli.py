"""`hetloco-ds`: train, export, simulate, plan, lighthouse, plot."""
from __future__ import annotations

import argparse
import os
import sys

DTYPE_CHOICES = ("bfloat16", "float16", "float32")


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="train (pre-train or fine-tune) a LLaMA with SparseLoCo + compressed pipelines")
    p.add_argument("--config", help="DeepSpeed JSON with a 'hetloco' section (default: configs/cpu_tiny.json)")
    p.add_argument("--model", help="Hugging Face save_pretrained directory or Hub model id to fine-tune from")
    p.add_argument("--tokenizer", help="tokenizer directory or Hub id (default: --model's, else the stdlib BPE)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, help="dtype of the exported OUT/hf (default: --model's)")
    p.add_argument("--model-config", help="preset name (tiny, 20M, 178M, 512M, 1B) or a JSON of LlamaConfig fields")
    p.add_argument("--data", help="text/jsonl/parquet files or a folder, or a Hub dataset name[:config] (default: the Python stdlib)")
    p.add_argument("--text-field", default="text", help="field of jsonl/parquet rows holding the text")
    p.add_argument("--out", help="output directory (default: runs/<time>)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per replica (0: load, convert, save)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints/latest")
    p.add_argument("--nproc", type=int, help="spawn this many local ranks (default: 2 x pipeline stages when not under a launcher)")
    # The `deepspeed` launcher appends --local_rank=N; the environment's LOCAL_RANK says the same.
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)


def _export_parser(sub) -> None:
    p = sub.add_parser("export", help="turn a training checkpoint into a Hugging Face directory")
    p.add_argument("checkpoint_dir")
    p.add_argument("out_dir")
    p.add_argument("--tag", help="checkpoint tag (default: the one named by 'latest')")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, help="dtype of the weights (default: the training source's)")


def _train(args) -> int:
    from .config import ConfigError
    from .launch import spawn, under_launcher
    from .train import TrainArgs, default_out, main_rank, prepare_inputs

    if args.steps < 0:
        print(f"hetloco-ds train: error: --steps {args.steps} must be >= 0", file=sys.stderr)
        return 2
    out = args.out or default_out()
    targs = TrainArgs(config=args.config, model=args.model, model_config=args.model_config, data=args.data,
                      out=out, steps=args.steps, resume=args.resume, text_field=args.text_field,
                      tokenizer=args.tokenizer, dtype=args.dtype)
    if under_launcher():
        return main_rank(targs)
    from .config import load_config

    try:
        stages = load_config(args.config).stages
        nproc = args.nproc or 2 * stages
        if nproc < 1:
            raise ConfigError(f"--nproc {nproc} must be >= 1")
        # Validate and build caches once, before any rank starts or anything is written.
        prepare_inputs(targs, nproc)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"hetloco-ds train: error: {err}", file=sys.stderr)
        return 2
    argv = ["train", "--out", out, "--steps", str(args.steps), "--text-field", args.text_field]
    for flag, value in (("--config", args.config), ("--model", args.model), ("--model-config", args.model_config),
                        ("--data", args.data), ("--tokenizer", args.tokenizer), ("--dtype", args.dtype)):
        if value is not None:
            argv += [flag, value]
    if args.resume:
        argv.append("--resume")
    return spawn(nproc, argv)


def _export(args) -> int:
    from . import convert

    try:
        convert.export(args.checkpoint_dir, args.out_dir, tag=args.tag, overwrite=args.overwrite, dtype=args.dtype)
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        print(f"hetloco-ds export: error: {err}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint_dir} -> {args.out_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:
        from .plan.cli import main as plan_main

        return plan_main(argv[1:])
    if argv[:1] == ["simulate"]:
        from .simulate import main as simulate_main

        return simulate_main(argv[1:])
    if argv[:1] == ["lighthouse"]:
        from .transport.lighthouse import main as lighthouse_main

        return lighthouse_main(argv[1:])
    if argv[:1] == ["plot"]:
        from .plot import main as plot_main

        return plot_main(argv[1:])
    parser = argparse.ArgumentParser(prog="hetloco-ds", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _export_parser(sub)
    sub.add_parser("simulate", help="M replicas x S virtual stages in one process (see `hetloco-ds simulate -h`)")
    sub.add_parser("plan", help="predict step time, utilisation and bytes (see `hetloco-ds plan -h`)")
    sub.add_parser("lighthouse", help="the lighthouse elastic replicas meet through (see `hetloco-ds lighthouse -h`)")
    sub.add_parser("plot", help="loss and bytes-by-link PNGs of a run (see `hetloco-ds plot -h`)")
    args = parser.parse_args(argv)
    if args.command == "train":
        return _train(args)
    if args.command == "export":
        return _export(args)
    return 2


if __name__ == "__main__":
    if os.environ.get("HETLOCO_QUIET"):
        os.environ.setdefault("TQDM_DISABLE", "1")
    sys.exit(main())
