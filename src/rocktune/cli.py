"""Command-line interface: argument parsing only.

Each subcommand is two small functions: ``_add_<name>`` declares its arguments and ``_run_<name>`` imports the
layer below lazily (so ``rocktune plan`` never imports torch's device code) and calls one function with flat
arguments. ``UserError`` becomes one clear paragraph and exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from rocktune import __version__, exits
from rocktune.data.truncate import MODES as TRUNCATION_MODES
from rocktune.dtypes import canonical, gguf_float
from rocktune.errors import UserError, print_error, quiet_libraries
from rocktune.export.merge import DTYPE_NAMES
from rocktune.export.style import STYLES
from rocktune import task_registry
from rocktune.task_registry import TASKS, demos, load


def main(argv: list[str] | None = None) -> int:
    quiet_libraries()
    parser = build_parser()
    args = parse(parser, sys.argv[1:] if argv is None else list(argv))
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        if args.debug:
            raise
        print_error(str(exc))
        return exits.USER_ERROR
    except KeyboardInterrupt:
        print_error("interrupted")
        return exits.INTERRUPTED


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Options may follow the dotted overrides (``train -c x.yaml lora.r=8 --nproc 2 training.lr=1e-4``): a command
    with overrides is parsed again, intermixed, from its own name on (a subparser is never parsed intermixed)."""
    args, extras = parser.parse_known_args(argv)
    intermixed = getattr(args, "intermixed", None)
    if extras and intermixed is not None:
        sub, path = intermixed
        start = 0
        for name in path:  # the command's words (``data preview``): only bare top-level flags come before them
            start = argv.index(name, start) + 1
        vars(args).update(vars(sub.parse_intermixed_args(argv[start:])))
    elif extras:
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    return args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rocktune", description="Rock-solid, fast LoRA fine-tuning.")
    parser.add_argument("--version", action="version", version=f"rocktune {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train(sub)
    _add_demo(sub)
    _add_plan(sub)
    _add_doctor(sub)
    _add_env(sub)
    _add_bench(sub)
    _add_data(sub)
    _add_report(sub)
    _add_export(sub)
    _add_generate(sub)
    return parser


# --- train -----------------------------------------------------------------------------------------------------


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="LoRA fine-tune a causal LM on your data")
    p.add_argument("-c", "--config", help="YAML config file (fields not given keep their defaults)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. training.lr=2e-4 lora.r=16")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config as YAML, each field's meaning as a comment, and exit")
    p.add_argument("--overwrite", action="store_true", help="replace an existing, different run in output.dir")
    p.add_argument("--resume", action="store_true", help="continue the run in output.dir from its last checkpoint")
    p.add_argument("--resume-force", action="store_true",
                   help="resume even though the config or data changed (the result is no longer one exact run)")
    p.add_argument("--auto", action="store_true",
                   help="let the memory planner choose micro-batch, accumulation, checkpointing and length")
    p.add_argument("--vram", help="memory budget for --auto, e.g. 24GiB (default: the detected device)")
    p.add_argument("--no-supervise", action="store_true",
                   help="train in this process instead of a supervised child that is restarted after a crash")
    g = p.add_argument_group("several processes (torchrun's launcher; docs/multi-gpu.md)")
    g.add_argument("--nproc", type=int, default=1, help="worker processes on this machine: one per GPU (gloo on CPU)")
    g.add_argument("--nnodes", type=int, default=1, help="machines taking part (default 1)")
    g.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0 .. nnodes-1 (static master)")
    g.add_argument("--master-addr", help="address of node 0 (static master; with --nnodes > 1)")
    g.add_argument("--master-port", type=int,
                   help="port on node 0 (default 29500); on one node, given: used instead of a free port")
    g.add_argument("--rdzv-endpoint", help="host:port of a c10d rendezvous instead of a static master")
    g.add_argument("--rendezvous-timeout", type=float, metavar="SECONDS",
                   help="how long the nodes wait for each other before the missing ones are named (default: "
                        "reliability.rendezvous_timeout_s, 300)")
    p.set_defaults(func=_run_train, intermixed=(p, ("train",)))


def _run_train(args) -> int:
    from rocktune.platform.stack import refuse_unsupported

    refuse_unsupported("train")  # an unusable torch/transformers pair: said here, not as an ImportError in a child
    from rocktune.config import dump_config, load_config
    from rocktune.process.pipes import guard_std_streams

    guard_std_streams()  # `rocktune train ... | head`: a closed pipe drops the output, never the run
    try:
        cfg = load_config(args.config, args.overrides, require_paths=not args.print_config)
    except UserError as exc:
        if args.config is None:  # the usual cause of "data.train_file ... (got {})": no -c at all
            raise UserError(f"{exc}. No config file was given: pass -c FILE.yaml (examples/*.yaml are ready to "
                            "copy), or give every required field as an override, e.g. model.name_or_path=... "
                            "data.train_file=...") from None
        raise
    cfg = vision_task(cfg)
    if args.print_config:
        sys.stdout.write(dump_config(cfg, comments=True))
        return 0
    from rocktune.platform.stack import refuse_task

    refuse_task(cfg.task)
    vram = None
    if args.vram and not args.auto:
        raise UserError("--vram is the budget for --auto; pass both, or neither.")
    if args.vram:
        from rocktune.planner.budget import parse_budget

        vram = parse_budget(args.vram)
    from rocktune.train.request import RunOptions, RunRequest

    launch = _launch(args)
    options = RunOptions(overwrite=args.overwrite, resume=args.resume or args.resume_force,
                         resume_force=args.resume_force, auto_fit=args.auto, vram_bytes=vram,
                         processes=launch.nproc * launch.nnodes if launch else 1)
    from rocktune.tasks import precheck, refuse_before_launch
    from rocktune.train.precheck import check_before_start

    refuse_before_launch(cfg, options)  # once, here: not once per rank after torchrun started them
    check_before_start(cfg, options)  # a clobbered run directory: refused before a child starts
    precheck(cfg)  # and a malformed line of the data
    if launch is not None:
        from rocktune.process.rendezvous import preflight

        launch.rendezvous_timeout_s = args.rendezvous_timeout or cfg.reliability.rendezvous_timeout_s
        preflight(launch, launch.rendezvous_timeout_s, say=lambda line: print(line, file=sys.stderr))
    request = RunRequest(cfg.model_dump(mode="json"), options, launch)
    if args.no_supervise and request.multi:
        from rocktune.process.launch import run_launcher

        return run_launcher(request)
    if args.no_supervise:
        from rocktune.process.worker import run_in_process

        return run_in_process(request)
    from rocktune.process.supervisor import supervise

    return supervise(request, cfg.reliability.max_restarts)


def vision_task(cfg):
    """The config's task for a vision-language checkpoint (config.json's model_type in vision_families.FAMILIES), as
    ``train`` and ``data preview`` both decide it: ``task`` left unset means task=vlm, said in one line on stderr (the
    run's saved config then says vlm, so --resume decides alike); a text task given explicitly is refused naming
    task: vlm, before transformers' "Unrecognized configuration class" or a preview that reads ``<image>`` as text."""
    if cfg.task not in task_registry.TEXT:  # a vision-language or diffusion task already
        return cfg
    from rocktune.tasks.vlm.vision.families import text_task_refusal, vision_checkpoint

    found = vision_checkpoint(cfg.model.name_or_path)
    if found is None:
        return cfg
    kind, family = found
    if "task" in cfg.model_fields_set:
        raise text_task_refusal(cfg.task, "the config's task key, or an override", f"model.name_or_path="
                                f"{cfg.model.name_or_path}", kind)
    print(f"note: {cfg.model.name_or_path} is a {family.name} vision-language model (config.json: model_type {kind}) "
          "and the config sets no task, so this is task: vlm; write task: vlm in the config to say so.",
          file=sys.stderr)
    return cfg.model_copy(update={"task": "vlm"})


def _launch(args):
    """The torchrun layout of ``--nproc``/``--nnodes``; None for one process (which never imports
    torch.distributed)."""
    if args.nproc < 1 or args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise UserError(f"--nproc and --nnodes must be at least 1 and --node-rank between 0 and nnodes-1 (got "
                        f"--nproc {args.nproc} --nnodes {args.nnodes} --node-rank {args.node_rank})")
    if args.rendezvous_timeout is not None and args.rendezvous_timeout <= 0:
        raise UserError(f"--rendezvous-timeout {args.rendezvous_timeout:g}: give a number of seconds above 0.")
    if args.nproc == 1 and args.nnodes == 1:
        if args.master_port is not None or args.master_addr:
            print("note: --master-addr/--master-port are for several processes; one process trains alone and uses "
                  "no port", file=sys.stderr)
        return None
    if args.nnodes > 1 and not (args.master_addr or args.rdzv_endpoint):
        raise UserError(f"--nnodes {args.nnodes} needs where node 0 is: --master-addr HOST (with --node-rank on each "
                        "machine) or --rdzv-endpoint HOST:PORT; see docs/multi-gpu.md")
    from rocktune.process.launch import check_available
    from rocktune.train.request import Launch

    check_available()
    # one node: --standalone picks a free port, unless --master-port was given (then it is used, on loopback)
    addr = args.master_addr or ("127.0.0.1" if args.nnodes == 1 and args.master_port is not None else None)
    port = args.master_port if args.master_port is not None else Launch.master_port
    return Launch(args.nproc, args.nnodes, args.node_rank, addr, port, args.rdzv_endpoint)


# --- demo ------------------------------------------------------------------------------------------------------


# what `make demo` takes, as README states it (tests/test_newcomer.py holds the two to the same figure)
DEMO_TIME = "about 25 s on a 2-core CPU once installed, 20 s of it training"


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help=f"train the built-in tiny model on a synthetic task (offline; {DEMO_TIME})")
    p.add_argument("--out", default=None, help="run directory (default: runs/demo, with --real runs/demo-real)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the demo's own)")
    p.add_argument("--overwrite", action="store_true", help="replace a different earlier demo run in --out")
    p.add_argument("--real", action="store_true",
                   help="teach a real pretrained chat model (SmolLM2-135M-Instruct, from the demo-real extra) a "
                        "new skill instead; a few minutes on a CPU")
    p.add_argument("--task", choices=demos(), default="lm",
                   help="dpo: preference tuning after SFT — the SFT demo's model (from --from, trained first when "
                        "absent) taught to prefer one style of answer; out: runs/demo-dpo. grpo: a short SFT, then "
                        "GRPO with the exact-answer reward; out: runs/demo-grpo")
    p.add_argument("--from", dest="sft_dir", default="runs/demo",
                   help="--task dpo: the SFT demo's --out to start from (default runs/demo)")
    p.set_defaults(func=_run_demo)


def _run_demo(args) -> int:
    if args.steps is not None and args.steps < 1:
        raise UserError(f"--steps must be at least 1, not {args.steps}")
    from rocktune.platform.stack import refuse_unsupported

    refuse_unsupported("demo")
    if args.real:
        from rocktune.demo.real import run_real_demo

        return run_real_demo(out_dir=args.out or "runs/demo-real", as_json=args.json, steps=args.steps,
                             overwrite=args.overwrite)
    return load(TASKS[args.task].demo)(args)  # the task's own demo (task_registry.py)


# --- doctor ----------------------------------------------------------------------------------------------------


def _add_doctor(sub) -> None:
    p = sub.add_parser("doctor", help="check this machine: platform, known-bad combinations, advice, self-tests")
    p.add_argument("--json", action="store_true", help="print one JSON object with keys platform, advice, checks")
    p.add_argument("--no-device", action="store_true",
                   help="do not touch the GPU: snapshot from the kernel's view, self-tests on the CPU")
    p.add_argument("--simulate", metavar="PLATFORM.json",
                   help="advice for a saved snapshot (the 'platform' of --json, or a whole report); runs nothing")
    p.add_argument("--no-checks", action="store_true", help="snapshot and advice only")
    p.add_argument("--no-perf", action="store_true", help="skip the TFLOP/s and GB/s measurements")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a hung check is killed (default 300)")
    p.add_argument("--nproc", type=int, default=1,
                   help="instead: start N processes (torchrun) and run train's multi-GPU preflight alone: barrier, "
                        "an all-reduce of known values, peer access, each under a timeout")
    p.add_argument("--model", metavar="PATH",
                   help="also train this model (hub id or local directory) a few steps on the device the way `train` "
                        "would (fused LoRA path, default optimizer, compiled where train compiles) against PEFT's "
                        "reference forward: a build that computes wrong gradients fails before a long run")
    p.set_defaults(func=_run_doctor)


def _run_doctor(args) -> int:
    from pathlib import Path

    if args.simulate and not Path(args.simulate).is_file():
        raise UserError(f"--simulate: no such file {args.simulate}")
    if args.timeout <= 0:
        raise UserError("--timeout must be positive")
    if not args.simulate:  # a simulated report's stack is judged in its advice instead (platform/advise.py)
        from rocktune.platform.stack import refuse_unsupported

        refuse_unsupported("doctor")
    if args.nproc > 1:
        from rocktune.process.launch import check_available, run_preflight

        check_available()
        return run_preflight(args.nproc, min(args.timeout, 120.0))
    from rocktune.doctor.main import run_doctor

    more = None
    if args.model:
        from rocktune.models.load import check_model_source
        from rocktune.tasks.causal import pathcheck

        check_model_source(args.model)  # a missing directory or a malformed id: the usual clear error, now
        more = lambda device, precision: (("rocktune.tasks.causal.pathcheck", args.model),  # noqa: E731
                                          pathcheck.names(device, precision))
    return run_doctor(as_json=args.json, no_device=args.no_device, simulate=args.simulate,
                      run_checks=not args.no_checks, perf=not args.no_perf, timeout=args.timeout, more=more)


# --- env -------------------------------------------------------------------------------------------------------


def _add_env(sub) -> None:
    p = sub.add_parser("env", help="print the environment variables rocktune advises for this machine (export lines)")
    p.add_argument("--shell", choices=["bash", "powershell"], help="line format (default: powershell on Windows)")
    p.add_argument("--simulate", metavar="PLATFORM.json", help="advise for a saved snapshot instead of this machine")
    p.add_argument("--arch", help="advise for this arch (e.g. gfx1151, sm_89, cpu) instead of the detected one")
    p.set_defaults(func=_run_env)


def _run_env(args) -> int:
    from pathlib import Path

    if args.simulate and not Path(args.simulate).is_file():
        raise UserError(f"--simulate: no such file {args.simulate}")
    if args.arch and not (args.arch == "cpu" or args.arch.startswith(("gfx", "sm_"))):
        raise UserError(f"--arch must look like gfx1100, sm_89 or cpu, not {args.arch!r}")
    from rocktune.platform.environment import print_env

    return print_env(shell=args.shell, simulate=args.simulate, arch=args.arch)


# --- plan ------------------------------------------------------------------------------------------------------


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="memory a LoRA run needs, from config.json alone, and settings that fit")
    p.add_argument("model", help="preset name (e.g. Qwen2.5-3B), a config.json, or a model directory")
    p.add_argument("--vram", help="memory budget, e.g. 32GiB or 24GB (default: the detected GPU, else system RAM; "
                   "on APUs give your own figure)")
    p.add_argument("--max-length", type=int, default=1024, help="tokens per example (default 1024)")
    p.add_argument("--batch", type=int, default=1, help="micro-batch size to break down (default 1)")
    p.add_argument("--global-batch", type=int, default=8, help="examples per optimizer step for the fit (default 8)")
    p.add_argument("--lora-r", type=int, default=8, help="LoRA rank (default 8)")
    p.add_argument("--targets", default="all-linear", help="all-linear (default) or a comma list, e.g. q_proj,v_proj")
    p.add_argument("--precision", default="bf16", type=canonical,  # the planner names the choices when refusing
                   help="fp32 | bf16 | fp16, or torch's float32 / bfloat16 / float16 (default bf16)")
    p.add_argument("--quant", default="none", help="none | nf4 | fp4 | int8 base weights (QLoRA, docs/qlora.md)")
    p.add_argument("--nproc", type=int, default=1, help="ranks training together: the breakdown is per rank")
    p.add_argument("--parallel", default="ddp", choices=("ddp", "fsdp"),
                   help="with --nproc > 1: ddp (base replicated) or fsdp (decoder layers sharded)")
    p.add_argument("--attn", default="sdpa", help="sdpa | eager | flash_attention_2 | varlen (rocktune's GPU path: "
                   "varlen attention over packed rows, the lean LoRA forward) (default sdpa)")
    p.add_argument("--compiled", action="store_true",
                   help="the decoder and the loss compiled, as a GPU run with token batching compiles them")
    p.add_argument("--checkpointing", action="store_true", help="break down with gradient checkpointing on")
    p.add_argument("--lora-dropout", type=float, default=0.0, help="LoRA dropout (default 0)")
    p.add_argument("--loss", choices=("chunked", "full"), default="chunked",
                   help="chunked: rocktune's loss-positions-only loss (default); full: HF labels= full logits")
    p.add_argument("--loss-chunk", type=int, default=256, help="loss positions per chunk (default 256)")
    p.add_argument("--device", choices=("gpu", "cpu"), default=None, help="what the budget is (default: detected)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--task", choices=tuple(TASKS), default="lm",
                   help="lm (default); dpo/orpo: --batch counts pairs (two sequences each); vlm: a vision-language "
                        "model directory (its images: see the vlm options); or a Wan LoRA "
                        "(video-lora, image-lora): MODEL is then a diffusers Wan directory or hub id")
    p.add_argument("--completion-length", type=int, default=512,
                   help="grpo: most tokens a completion may have (grpo.max_completion_length; default 512); "
                        "--max-length is then the prompt's bound")
    p.add_argument("--rollout-rows", type=int, default=None,
                   help="grpo: completions sampled together, micro_batch_size x grad_accum (default: --global-batch)")
    p.add_argument("--resolution", default="832x480", help="video-lora/image-lora: WIDTHxHEIGHT (default 832x480)")
    p.add_argument("--frames", type=int, default=81, help="video-lora: frames per clip, 4k+1 (default 81)")
    p.add_argument("--text-tokens", type=int, default=512,
                   help="video-lora/image-lora: text positions per sample (default 512: what training and WanPipeline "
                        "use; change it only to plan for another pipeline); vlm without --data: tokens per "
                        "conversation besides its images (default 512)")
    g = p.add_argument_group("vlm (docs/vision.md): MODEL is a vision-language model directory")
    g.add_argument("--data", help="the training data: each image's size and each conversation's tokens, read as "
                   "training reads them (default: one assumed conversation, see --image-size)")
    g.add_argument("--max-pixels", type=int, help="data.max_pixels (default: the model's preprocessor_config.json)")
    g.add_argument("--min-pixels", type=int, help="data.min_pixels (default: the model's preprocessor_config.json)")
    g.add_argument("--image-size", help="without --data: WIDTHxHEIGHT of each image as stored (default: a square of "
                   "max_pixels)")
    g.add_argument("--images", type=int, default=1, help="without --data: images per conversation (default 1)")
    p.set_defaults(func=_run_plan)


def _run_plan(args) -> int:
    vlm_only = [f"--{k.replace('_', '-')}" for k in ("data", "max_pixels", "min_pixels", "image_size")
                if getattr(args, k) is not None]
    if vlm_only and args.task not in task_registry.VISION:
        raise UserError(f"{', '.join(vlm_only)}: only for --task vlm (a vision-language model's images).")
    return load(TASKS[args.task].plan)(args)  # the task's own plan (task_registry.py)


# --- bench -----------------------------------------------------------------------------------------------------


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="measure rocktune's speed knobs side by side with the HF Trainer + PEFT recipe")
    p.add_argument("--model", default="tiny",
                   help="local model directory, or a random-init shape: tiny (CPU default), qwen3.5-tiny-shape "
                        "(tiny's size, Qwen3.5's hybrid Gated DeltaNet stack), qwen2.5-0.5b-shape, qwen2.5-1.5b-shape")
    p.add_argument("--data", help="JSON/JSONL training data (default: synthetic prompt/completion, 50-500 tokens)")
    p.add_argument("--configs", help="comma-separated configuration names or 'all' (default: this device's set; "
                                     "see --list)")
    p.add_argument("--steps", type=int, default=5, help="measured optimizer steps per configuration (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps run first and excluded (default 1)")
    p.add_argument("--parity-steps", type=int, default=4,
                   help="steps of the loss-parity pair, rocktune vs HF on the same samples (0: skip; default 4)")
    p.add_argument("--threads", type=int, help="torch threads for every configuration (default: torch's)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (ROCm builds too)")
    p.add_argument("--samples", type=int, default=400, help="examples in the synthetic data (default 400)")
    p.add_argument("--out", default="runs/bench", help="scratch runs, cache and report.json (default runs/bench)")
    p.add_argument("--nproc", type=int, default=1,
                   help="also run rocktune's defaults on N processes (rocktune train --nproc N, same global batch)")
    p.add_argument("--suite", choices=("gpu", "vlm", "moe"),
                   help="a named suite: gpu = both Qwen2.5 shapes, 64 examples of 50-2,000 tokens per step, rocktune "
                        "vs hf-seed and hf-best, MFU targets (--model replaces the shapes, e.g. tiny for a CPU dry "
                        "run); vlm = task=vlm vs the HF Trainer + PEFT on a tiny Qwen2.5-VL (docs/vision.md); moe = "
                        "the expert LoRA vs HF + PEFT target_parameters on a tiny Qwen3-MoE and a Qwen3-30B-A3B layer "
                        "(--model tiny-moe or qwen3-30b-a3b-layer for one; docs/moe.md)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before one configuration is killed")
    p.add_argument("--lr", type=float,
                   help="learning rate of every configuration (default 2e-4): a random-init shape whose loss barely "
                        "moves at the default in a few steps gives no speed figure; a larger one makes it fall")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the whole set this many times, alternating the order; medians pool all rounds")
    p.add_argument("--json", action="store_true", help="print the whole report as one JSON object")
    p.add_argument("--pick", action="store_true", help="sweep rocktune's candidates and write the fastest as YAML")
    p.add_argument("--write-config", help="where --pick writes the config (default <out>/best.yaml)")
    p.add_argument("--list", action="store_true", help="list the configurations and exit")
    p.set_defaults(func=_run_bench)


def _run_bench(args) -> int:
    if args.steps < 1:
        raise UserError(f"--steps must be at least 1, not {args.steps}")
    if args.warmup < 0 or args.parity_steps < 0 or args.samples < 8:
        raise UserError("--warmup and --parity-steps cannot be negative; --samples must be at least 8")
    if args.threads is not None and args.threads < 1:
        raise UserError("--threads must be at least 1")
    if args.lr is not None and not args.lr > 0:
        raise UserError(f"--lr must be a positive learning rate, not {args.lr}")
    from rocktune.bench.main import run_bench_command
    from rocktune.bench.runner import BenchRequest

    req = BenchRequest(model=args.model, data=args.data, configs=args.configs, steps=args.steps,
                       warmup=args.warmup, threads=args.threads, device=args.device, out=args.out,
                       n_samples=args.samples, parity_steps=args.parity_steps, timeout=args.timeout,
                       rounds=args.rounds, nproc=args.nproc, common={"lr": args.lr} if args.lr else None)
    return run_bench_command(req, as_json=args.json, pick=args.pick, write_config=args.write_config,
                             list_only=args.list, suite=args.suite)


# --- data preview / report -------------------------------------------------------------------------------------


def _add_data(sub) -> None:
    p = sub.add_parser("data", help="look at training data before training on it")
    data_sub = p.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND")
    q = data_sub.add_parser("preview", help="counts, lengths, trained tokens highlighted, and the checks train runs")
    q.add_argument("-c", "--config", help="YAML config: its data and model sections are previewed")
    q.add_argument("overrides", nargs="*", help="dotted overrides, with -c or with --data, e.g. data.max_length=512, "
                   "task=dpo (previews preference pairs), data.tools=drop")
    q.add_argument("--data", help="data file (JSON/JSONL, parquet, CSV, Arrow, .txt/.md), a folder of text files, "
                   "save_to_disk folder or hub dataset id "
                   "(instead of -c)")
    q.add_argument("--model", help="model (its tokenizer and chat template) to encode with (instead of -c)")
    q.add_argument("--format", default="auto", choices=("auto", "text", "prompt_completion", "messages", "alpaca"),
                   help="record shape with --data (default: detected)")
    q.add_argument("--max-length", type=int, default=1024, help="tokens per example with --data (default 1024)")
    q.add_argument("--train-on-prompt", action="store_true", help="with --data: loss on prompts too")
    q.add_argument("--truncation", default="prompt", choices=TRUNCATION_MODES,
                   help="with --data: how long examples are cut (see data.truncation; default prompt)")
    q.add_argument("-n", "--examples", type=int, default=3, help="examples shown token by token (default 3)")
    q.add_argument("--html", metavar="FILE", help="also write the preview as an HTML page")
    q.add_argument("--json", action="store_true", help="print one JSON object")
    q.set_defaults(func=_run_data_preview, intermixed=(q, ("data", "preview")))


def _run_data_preview(args) -> int:
    if args.config or (args.data and args.model):
        from rocktune.config import load_config

        cfg = vision_task(load_config(args.config, args.overrides) if args.config else
                          load_config(None, args.overrides, base=_preview_flags(args)))
        return load(cfg.spec.preview)(cfg, args.examples, args.json, args.html)  # the task's own (task_registry)
    raise UserError("rocktune data preview needs -c CONFIG, or both --data FILE and --model MODEL.")


def _preview_flags(args) -> dict:
    """The settings ``--data`` / ``--model`` and the flags give, as a config's sections; the dotted overrides
    (``task=dpo``, ``data.columns=...``) go on top. A flag left at its default is not set, so that a task the flag
    does not apply to (data.format for dpo) is not refused for it."""
    data = {"train_file": args.data}
    flags = {"format": (args.format, "auto"), "max_length": (args.max_length, 1024),
             "train_on_prompt": (args.train_on_prompt, False), "truncation": (args.truncation, "prompt")}
    data.update({key: value for key, (value, default) in flags.items() if value != default})
    return {"model": {"name_or_path": args.model}, "data": data}


def _add_report(sub) -> None:
    p = sub.add_parser("report", help="plots and one self-contained HTML page of a run (several runs: overlaid)")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (output.dir of rocktune train)")
    p.add_argument("--out", help="HTML file to write (default: RUN_DIR/report.html; several runs: compare.html)")
    p.set_defaults(func=_run_report)


def _run_report(args) -> int:
    from rocktune.report.run_report import run_report

    return run_report(run_dirs=args.runs, out=args.out)


# --- export / generate -------------------------------------------------------------------------------------------


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="use the trained adapter: merged model, GGUF, GGUF LoRA or Ollama bundle")
    p.add_argument("run", help="run directory (holding adapter/), or a model directory for --to gguf/ollama")
    p.add_argument("--to", required=True, choices=("merged", "gguf", "gguf-lora", "ollama"),
                   help="merged: transformers model directory; gguf: one file for llama.cpp/LM Studio; "
                        "gguf-lora: the adapter alone for llama.cpp --lora / Ollama ADAPTER; ollama: GGUF + Modelfile")
    p.add_argument("--out",
                   help="output path (default: RUN/export/merged, model-QUANT.gguf, adapter-f32.gguf, ollama/)")
    p.add_argument("--quant", type=gguf_float,
                   help="GGUF type: f32 f16 bf16 q8_0 q5_0 q4_0 q6_k q5_k_m q4_k_m (default f16; gguf-lora: f32 or "
                        "f16, default f32); float16 / bfloat16 / float32 also name the float types")
    p.add_argument("--dtype", default="auto", type=canonical, choices=DTYPE_NAMES,
                   help="merged weights' dtype: fp32 | bf16 | fp16 or torch's float32 / bfloat16 / float16 (default: "
                        "the base checkpoint's); the merge itself is fp32")
    p.add_argument("--base", help="base model directory or hub id (default: the one the run trained on)")
    p.add_argument("--with-base", action="store_true", help="gguf-lora: also write the base as base-f16.gguf")
    p.add_argument("--template", default="auto", choices=STYLES,
                   help="ollama: prompt format of the Modelfile (default: the one the run trained with)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    _add_trust_remote_code(p)
    p.set_defaults(func=_run_export)


def _add_trust_remote_code(p) -> None:
    # The only way to allow it: a run directory's own model.trust_remote_code is refused (it may come from anywhere)
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run Python code shipped with the base model (off; a run directory cannot turn it on)")


def _run_export(args) -> int:
    from rocktune.tempdir import private_tempdir

    with private_tempdir():  # entered before torch is imported: its compile cache goes there and is removed after
        return _export(args)


def _export(args) -> int:
    from rocktune.export.main import run_export
    from rocktune.export.source import Origin

    from rocktune.tasks.wan.diffusion.comfy import LORA_FILE
    from rocktune.tasks.wan.diffusion.generate_cli import run_config

    if run_config(args.run) is not None:
        raise UserError(f"{args.run} is a video-lora/image-lora run: its LoRA is already exported as "
                        f"{args.run}/{LORA_FILE} (ComfyUI models/loras, diffusers "
                        "WanPipeline.load_lora_weights); rocktune export converts LM adapters.")
    run_export(Origin(args.run, args.base, args.trust_remote_code), to=args.to, out=args.out, quant_name=args.quant,
               dtype=args.dtype, overwrite=args.overwrite, with_base=args.with_base, template=args.template)
    return 0


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate with the trained adapter (or a merged model) to see what it learned")
    p.add_argument("run", help="run directory (holding adapter/) or a model directory")
    p.add_argument("--prompt", help="one prompt; prints the reply")
    p.add_argument("--chat", action="store_true", help="a short interactive loop on the terminal (the default)")
    p.add_argument("--file", help="JSONL of {\"prompt\": ...} or {\"messages\": [...], \"tools\": [...]} (tools go "
                   "through the chat template); prints each line back with \"output\"")
    p.add_argument("--base", help="base model directory or hub id (default: the one the run trained on)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="reply length limit in tokens (default 128)")
    p.add_argument("--template", default="auto", choices=STYLES,
                   help="prompt format (default: the run's training format; chat template for model directories)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; above 0: sampling")
    p.add_argument("--device", default="auto", help="auto (GPU when present), cpu or cuda (ROCm builds too)")
    p.add_argument("--image", action="append", help="task=vlm runs: an image the --prompt asks about (a path, file:// "
                   "or data: URL); repeat for several")
    p.add_argument("--compare", action="store_true", help="with --prompt or --file: also answer with the adapter "
                   "switched off (--file: \"base_output\" beside \"output\"; video-lora/image-lora: also render "
                   "the base alone from the same seed, as NAME-base.mp4)")
    _add_trust_remote_code(p)
    d = p.add_argument_group("video-lora / image-lora runs (renders RUN/wan_lora.safetensors)")
    d.add_argument("--out", help="output file, .mp4 or .png (default RUN/samples/<prompt>-seed<N>.mp4, .png for 1 "
                   "frame)")
    d.add_argument("--size", help="WIDTHxHEIGHT, multiples of 16 (default: the run's first diffusion.resolutions)")
    d.add_argument("--frames", type=int, help="4k+1 frames (default: the run's first diffusion.frames; image-lora: 1)")
    d.add_argument("--steps", type=int, help="denoising steps (default 30)")
    d.add_argument("--seed", type=int, help="noise seed (default 0)")
    d.add_argument("--guidance", type=float, help="classifier-free guidance scale (default 5.0; 1 turns it off)")
    d.add_argument("--negative-prompt", help="what to steer away from (default none)")
    p.set_defaults(func=_run_generate)


_DIFFUSION_OPTIONS = ("out", "size", "frames", "steps", "seed", "guidance", "negative_prompt")


def _run_generate(args) -> int:
    from rocktune.tempdir import private_tempdir

    with private_tempdir():  # entered before torch is imported: its compile cache goes there and is removed after
        return _generate(args)


def _generate(args) -> int:
    from rocktune.tasks.wan.diffusion.generate_cli import run_config

    if run_config(args.run) is not None:
        return _run_generate_media(args)
    given = [f"--{name.replace('_', '-')}" for name in _DIFFUSION_OPTIONS if getattr(args, name) is not None]
    if given:
        raise UserError(f"{', '.join(given)} apply to video-lora/image-lora runs only; {args.run} is not one.")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {args.max_new_tokens}: a reply needs at least 1 token (default 128).")
    if args.temperature < 0:
        raise UserError(f"--temperature {args.temperature}: cannot be negative; 0 decodes greedily, above 0 samples "
                        "(0.7 is usual).")
    from rocktune.export.generate import run_generate
    from rocktune.export.source import Origin
    from rocktune.tasks.vlm.export.vision_generate import is_vision_dir, run_generate_vision

    if args.image or is_vision_dir(args.run):
        if args.chat or args.file:
            raise UserError("a vision-language run answers one --prompt about its --image files; --chat and --file "
                            "are not available for it yet.")
        return run_generate_vision(Origin(args.run, args.base, args.trust_remote_code), args.prompt, args.image or [],
                                   (args.max_new_tokens, args.temperature), args.device, args.compare)
    return run_generate(Origin(args.run, args.base, args.trust_remote_code), prompt=args.prompt, chat=args.chat,
                        file=args.file, max_new_tokens=args.max_new_tokens, template=args.template,
                        temperature=args.temperature, device=args.device, compare=args.compare)


def _run_generate_media(args) -> int:
    if args.prompt is None or args.chat or args.file:
        raise UserError(f"{args.run} is a video-lora/image-lora run: give --prompt TEXT (--chat and --file are for "
                        "language-model runs).")
    from rocktune.tasks.wan.diffusion.generate_cli import Request, main
    from rocktune.platform.environment import resolve_device

    chosen = {name: getattr(args, name) for name in _DIFFUSION_OPTIONS if getattr(args, name) is not None}
    return main(args.run, Request(prompt=args.prompt, base=args.base, compare=args.compare, **chosen),
                resolve_device(args.device))
