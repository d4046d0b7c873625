"""`hetloco-ds`: train, export, simulate, plan, lighthouse, plot."""
from __future__ import annotations

import argparse
import os
import sys

DTYPE_CHOICES = ("bfloat16", "float16", "float32")


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="train (pre-train or fine-tune) a LLaMA with SparseLoCo + compressed pipelines")
    p.add_argument("--config", help="DeepSpeed JSON with a 'hetloco' section (default: configs/cpu_tiny.json; "
                                    "under `accelerate launch`, its --deepspeed_config_file)")
    p.add_argument("--model", help="Hugging Face save_pretrained directory or Hub model id to fine-tune from")
    p.add_argument("--tokenizer", help="tokenizer directory or Hub id (default: --model's, else the stdlib BPE)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, help="dtype of the exported OUT/hf (default: --model's)")
    p.add_argument("--model-config", help="preset name (tiny, 20M, 178M, 512M, 1B) or a JSON of LlamaConfig fields")
    p.add_argument("--data", help="text/jsonl/parquet files or a folder, or a Hub dataset name[:config] (default: the Python stdlib)")
    p.add_argument("--text-field", help="field of jsonl/parquet rows holding the text (default: text)")
    p.add_argument("--out", help="output directory (default: runs/<time>); one run owns it")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per replica (0: load, convert, save)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its newest complete checkpoint, with its own config, model "
                        "and data unless given (they must then match)")
    p.add_argument("--overwrite", action="store_true", help="replace the run that --out already holds")
    p.add_argument("--nproc", type=int, help="spawn this many local ranks (default: 2 x pipeline stages when not under a "
                                             "launcher; one replica's stages with --lighthouse)")
    p.add_argument("--bind-cores", action="store_true",
                   help="pin each rank --nproc starts to its own share of this process's cores, with OpenMP sized to it "
                        "(as deepspeed --bind_cores_to_rank); off by default: two jobs launched apart would share cores")
    p.add_argument("--link", action="append", metavar="CLASS=RATE",
                   help="rehearse on emulated links (Linux, root): shape stage or replica links, e.g. --link stage=100mbit "
                        "--link replica=1G; ends with measured vs planned step time (hetloco_ds.rehearse)")
    e = p.add_argument_group("elastic mode", "each replica its own job, meeting at the outer sync through a torchft "
                                             "lighthouse (README: Elastic replicas)")
    e.add_argument("--lighthouse", metavar="ADDR", help="join the fleet of this lighthouse (http://HOST:PORT, printed by "
                                                        "`hetloco-ds lighthouse`) as one replica; writes OUT/replica-ID")
    e.add_argument("--replica-id", type=int, metavar="ID", help="this replica's id in 0..hetloco.elastic.max_replicas-1 "
                                                               "(picks its data shard)")
    e.add_argument("--secret-file", help="file (mode 600) holding the fleet's shared secret (default: "
                                         "$HETLOCO_FLEET_SECRET; never on the command line)")
    e.add_argument("--bind", default="127.0.0.1", help="address this replica listens on (default 127.0.0.1)")
    e.add_argument("--advertise", help="address other replicas reach this one at (default: --bind)")
    e.add_argument("--elastic", action="store_true",
                   help="on this machine: start a lighthouse and --nproc / stages replicas, each its own job")


def _export_parser(sub) -> None:
    p = sub.add_parser("export", help="turn a training checkpoint into a Hugging Face directory")
    p.add_argument("checkpoint_dir")
    p.add_argument("out_dir")
    p.add_argument("--tag", help="checkpoint tag (default: the one named by 'latest')")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, help="dtype of the weights (default: the training source's)")


def _default_nproc(targs) -> int:
    """2 x stages for a new run (one replica of a fleet: its stages); the run's own world size for --resume."""
    from . import rundir
    from .config import default_config_path, parse_config
    from .runplan import config_path, read_config_file

    if targs.resume:
        record = rundir.read_record(targs.out)
        if config_path(targs) is None:
            return record["world_size"]
    path = config_path(targs) or default_config_path()
    run = parse_config(read_config_file(path), path)
    depths = run.hetloco.replica_stages
    if depths is not None and targs.fleet is None:
        return sum(depths)  # one rank per stage of every replica
    if depths is not None and 0 <= targs.fleet.replica < len(depths):
        return depths[targs.fleet.replica]  # one replica of an elastic fleet: its own depth
    return (1 if targs.fleet is not None else 2) * run.stages


def _train(args) -> int:
    import shutil
    import uuid

    from .config import ConfigError
    from .rundir import state_dir
    from .launch import STOP_GRACE_S, core_shares, spawn, under_launcher
    from .elastic import replica as fleet
    from .runplan import TrainArgs, default_out, own_run, plan_run
    from .train import ENV_JOB, ENV_OWNED, ENV_TAG, EXIT_BAD_INPUT, main_rank

    def fail(message: str) -> int:
        print(f"hetloco-ds train: error: {message}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT

    if args.steps < 0:
        return fail(f"--steps {args.steps} must be >= 0")
    try:
        fleet_args = fleet.from_flags(args.elastic, args.lighthouse, args.replica_id, args.secret_file, args.bind,
                                      args.advertise)
    except ConfigError as err:
        return fail(str(err))
    targs = TrainArgs(config=args.config, model=args.model, model_config=args.model_config, data=args.data,
                      out=args.out, steps=args.steps, resume=args.resume, overwrite=args.overwrite,
                      text_field=args.text_field, tokenizer=args.tokenizer, dtype=args.dtype, fleet=fleet_args)
    if args.link:  # a rehearsal on shaped links: check it can run before anything else
        from . import rehearse

        if fleet_args is not None:
            return fail("--link rehearses one static job; elastic replicas (--lighthouse, --elastic) are not shaped")
        if args.bind_cores:
            return fail("--bind-cores is not supported with --link (the rehearsal starts its ranks in network namespaces)")
        if (why := rehearse.problem(args.link, under_launcher())) is not None:
            return fail(why)
    if under_launcher():
        if args.nproc is not None or args.bind_cores:
            flag = f"--nproc {args.nproc}" if args.nproc is not None else "--bind-cores"
            return fail(f"{flag} is for starting ranks without a launcher; this process is already "
                        f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} under one")
        if args.elastic:
            return fail("--elastic starts its own jobs; under a launcher run one replica with --lighthouse")
        if fleet_args is not None and targs.out is not None:
            targs.out = fleet.replica_dir(targs.out, fleet_args.replica)
        return main_rank(targs)
    if targs.out is None:
        targs.out = default_out()
    fleet_out = targs.out
    if args.elastic:
        return _train_fleet(args, targs, fail)
    if fleet_args is not None:
        targs.out = fleet.replica_dir(fleet_out, fleet_args.replica)
    try:
        nproc = args.nproc if args.nproc is not None else _default_nproc(targs)
        # Every check, once, before any rank starts or anything is written.
        plan = plan_run(targs, nproc)
        if args.link and plan.run.hetloco.replica_stages is not None:
            raise ConfigError(f"{plan.run.source}: hetloco.replica_stages = {plan.run.hetloco.replica_stages}: --link "
                              "rehearses DeepSpeed's M x pipeline.stages layout only")
        if args.bind_cores:
            core_shares(nproc)  # fewer cores than ranks: one line now, not from inside spawn
        if plan.resume is not None and plan.resume.note:
            print(f"[hetloco] {plan.resume.note}", flush=True)
        lock = own_run(plan)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        return fail(str(err))
    argv = ["train", "--out", fleet_out, "--config", args.config, *_job_flags(args)]
    if args.config is None:
        argv[3:5] = []
    argv += [flag for flag, on in (("--resume", args.resume), ("--overwrite", args.overwrite)) if on]
    if fleet_args is not None:
        argv += fleet.flags(fleet_args)
    env = dict(os.environ, **{ENV_OWNED: "1", ENV_JOB: uuid.uuid4().hex[:12]})
    if plan.resume is not None:
        env[ENV_TAG] = plan.resume.tag
    try:
        if args.link:
            return rehearse.run(nproc, argv, args.link, targs.out, plan.run.stages, env)
        # Told to stop, the ranks get their grace to save plus the launcher's to see them exit; after
        # a rank failed no save can complete (it needs every rank), so the others stop at once.
        return spawn(nproc, argv, env=env, bind_cores=args.bind_cores,
                     grace_s=plan.run.hetloco.train.preempt_grace_s + STOP_GRACE_S, failed_grace_s=0.0)
    finally:
        shutil.rmtree(state_dir(targs.out, "heartbeat"), ignore_errors=True)  # the job is over
        lock.release()


def _job_flags(args) -> list[str]:
    """--steps and the inputs' flags, as every rank of the job gets them."""
    argv = ["--steps", str(args.steps)]
    for flag, value in (("--model", args.model), ("--model-config", args.model_config), ("--data", args.data),
                        ("--text-field", args.text_field), ("--tokenizer", args.tokenizer), ("--dtype", args.dtype)):
        if value is not None:
            argv += [flag, value]
    return argv


def _train_fleet(args, targs, fail) -> int:
    """`--elastic`: a lighthouse and --nproc / stages replica jobs on this machine (elastic.launcher)."""
    from .elastic import launcher
    from .config import ConfigError

    try:
        return launcher.launch(targs, args.nproc, _job_flags(args), bind_cores=args.bind_cores)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        return fail(str(err))


def _export(args) -> int:
    from . import hf_export

    try:
        hf_export.export(args.checkpoint_dir, args.out_dir, tag=args.tag, overwrite=args.overwrite, dtype=args.dtype)
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        print(f"hetloco-ds export: error: {err}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint_dir} -> {args.out_dir}")
    return 0


def _take_local_rank(argv: list[str]) -> list[str]:
    """The `deepspeed` launcher puts --local_rank=N before the subcommand; LOCAL_RANK says the same."""
    rest, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--local_rank=") or arg.startswith("--local-rank="):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
        elif arg in ("--local_rank", "--local-rank") and i + 1 < len(argv):
            os.environ.setdefault("LOCAL_RANK", argv[i + 1])
            i += 1
        else:
            rest.append(arg)
        i += 1
    return rest


def main(argv: list[str] | None = None) -> int:
    argv = _take_local_rank(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:
        from .plan.cli import main as plan_main

        return plan_main(argv[1:])
    if argv[:1] == ["simulate"]:
        from .sim.cli import main as simulate_main

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
