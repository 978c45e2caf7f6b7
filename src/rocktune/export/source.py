"""What an export starts from: a run directory's adapter and the base it was trained on, checked before any work.

A run directory holds ``adapter/`` (PEFT format) and ``config.yaml``; a merged or plain model directory (a
``config.json`` beside weights) is accepted too where no adapter is needed (``generate``). The base comes from the
run's own record unless ``--base`` overrides it, and a base whose shapes differ from the adapter's is refused here,
before a weight is loaded.

Remote code (a model's own Python files, ``trust_remote_code``) runs only when the command line says so
(``--trust-remote-code``): a run directory or adapter may come from anywhere, so its ``model.trust_remote_code: true``
is a request that is refused, naming the file, never a permission.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rocktune.errors import UserError, first_line
from rocktune.readers.adapter import read_adapter
from rocktune.readers.yaml_file import read_yaml

# a run directory's files are rocktune's own; one that does not read was damaged or replaced
RETRAIN = "the run directory is damaged: restore it from a copy, or train again"


@dataclass
class Source:
    base: str                 # model directory or hub id of the base (or of the merged model when adapter is None)
    adapter: Path | None      # the PEFT adapter directory, None for a plain model directory
    run_config: dict          # the run's resolved config ({} for a plain model directory)
    trust_remote_code: bool   # given on the command line; never taken from run_config


@dataclass(frozen=True)
class Origin:
    """What the command line names: the run (or adapter, or model) directory, ``--base`` and ``--trust-remote-code``."""
    path: str
    base: str | None = None
    trust_remote_code: bool = False


def resolve(path: str, base_override: str | None = None, trust_remote_code: bool = False) -> Source:
    """A run directory (or its adapter/ folder) or a model directory -> what to load, with the base checked.
    ``trust_remote_code``: the user's own ``--trust-remote-code``, the only way remote code is allowed."""
    root = Path(path)
    if not root.exists():
        raise UserError(f"{path} does not exist; pass a run directory (the training's output.dir, holding "
                        "adapter/) or a model directory.")
    adapter = _find_adapter(root)
    if adapter is None:
        if (root / "config.json").is_file():
            _check_local_model(base_override or str(root))
            return Source(base_override or str(root), None, {}, trust_remote_code)
        raise UserError(f"{path} holds no adapter: expected {root / 'adapter' / 'adapter_config.json'} (written "
                        "when a training run finishes) or a model directory with config.json. Was the run "
                        "interrupted before its end? `rocktune train --resume` finishes it.")
    run_config, config_file = _read_run_config(adapter)
    model = run_config.get("model", {}) if isinstance(run_config.get("model"), dict) else {}
    # config and weights read here, hardened, before PEFT parses them on its own
    adapter_config = read_adapter(adapter, f"{RETRAIN} (or re-export the adapter).").config
    base = base_override or model.get("name_or_path") or adapter_config.get("base_model_name_or_path")
    if not base:
        raise UserError(f"{adapter}: the adapter does not name its base model; pass --base MODEL_DIR_OR_ID.")
    if model.get("trust_remote_code") and not trust_remote_code:
        raise UserError(_remote_code_refusal(config_file, base))
    _check_base_exists(base, adapter, base_override is not None)
    _check_local_model(str(base))
    src = Source(str(base), adapter, run_config, trust_remote_code)
    check_shapes(src)
    return src


def _find_adapter(root: Path) -> Path | None:
    for cand in (root / "adapter", root):
        if (cand / "adapter_config.json").is_file():
            return cand
    return None


def _read_run_config(adapter: Path) -> tuple[dict, Path | None]:
    """The run's config and the file it came from (None: neither file is there)."""
    for cand in (adapter / "rocktune_config.yaml", adapter.parent / "config.yaml"):
        if cand.is_file():
            data = read_yaml(cand, RETRAIN + ".")[0] or {}
            if not isinstance(data, dict):
                raise UserError(f"{cand} does not hold a run's config (a mapping of sections); {RETRAIN}.")
            return data, cand
    return {}, None


def _remote_code_refusal(config_file: Path, base: str) -> str:
    return (f"{config_file} sets model.trust_remote_code: true, which would run the Python code shipped with the base "
            f"model {base}. It was not honoured: a run directory or adapter can come from anywhere, so it never turns "
            "code execution on by itself, and nothing was loaded. If you trust that model's code, pass "
            "--trust-remote-code to this command.")


def _check_local_model(base: str) -> None:
    """The base (or plain model) directory checked as ``train`` checks it: config.json and every safetensors header
    bounded and inside its file (the targets that need a tokenizer say so themselves); a hub id is left to the
    loader."""
    from rocktune.models.check import check_model_dir

    check_model_dir(base, tokenizer=False)


def _check_base_exists(base: str, adapter: Path, overridden: bool) -> None:
    from rocktune.models.load import check_model_source

    try:
        check_model_source(base)
    except UserError:
        how = "check --base" if overridden else "the run's model.name_or_path is relative to where training ran " \
              "or was moved; pass --base MODEL_DIR (the same base the adapter was trained on)"
        raise UserError(f"the base model {base} of {adapter} does not exist; {how}.") from None
    local = base.startswith((".", "/", "~")) or Path(base).exists()
    if local and not (Path(base).expanduser() / "config.json").is_file():
        raise UserError(f"the base model directory {base} has no config.json; pass --base with the directory "
                            "of a Hugging Face model (config.json + weights).")


def load_config(name_or_path: str, trust_remote_code: bool):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise UserError(f"could not read the config of {name_or_path}: {first_line(exc)} "
                        "(offline? pass a local model directory with --base)") from None


def check_shapes(src: Source) -> None:
    """Every LoRA pair must fit the base module it adapts: (r, in) and (out, r). Checked on a weightless model."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from rocktune.tasks.vlm.vision.model import model_class

    weights = read_adapter(src.adapter, f"{RETRAIN}.").weights
    config = load_config(src.base, src.trust_remote_code)
    vision = model_class(config)  # a vision-language base (task=vlm): its own class, vision tower included
    with torch.device("meta"):
        model = vision._from_config(config) if vision else \
            AutoModelForCausalLM.from_config(config, trust_remote_code=src.trust_remote_code)
    modules = dict(model.named_modules())
    with safe_open(str(weights), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            if ".lora_A." not in key and ".lora_B." not in key:
                continue
            name = key.removeprefix("base_model.model.").split(".lora_")[0]
            while name.endswith(".base_layer"):  # PEFT nests one wrapper per targeted parameter (MoE experts)
                name = name.removesuffix(".base_layer")
            shape = tuple(f.get_slice(key).get_shape())
            _check_pair(src, key, name, shape, modules.get(name))


def _check_pair(src: Source, key: str, name: str, shape: tuple, module) -> None:
    if module is None:
        raise UserError(f"the adapter tensor {key} adapts {name}, which the base {src.base} does not have; the "
                        "adapter was trained on another architecture: pass --base with its own base model.")
    if hasattr(module, "num_embeddings"):
        want = (None, module.num_embeddings) if ".lora_A." in key else (module.embedding_dim, None)
    elif not hasattr(module, "in_features"):  # MoE experts: LoRA on 3-D (expert, out, in) parameters
        dims = {d for p in module.parameters(recurse=False) if p.dim() == 3 for d in p.shape[1:]}
        if dims and shape[1 if ".lora_A." in key else 0] in dims:
            return
        raise UserError(f"the adapter tensor {key} has shape {list(shape)}, which fits no expert weight of {name} "
                        f"of the base {src.base} (expert dimensions {sorted(dims)}); this adapter was trained on "
                        "another base: pass --base with the model it was trained on.")
    else:
        want = (None, module.in_features) if ".lora_A." in key else (module.out_features, None)
    if any(w is not None and w != s for w, s in zip(want, shape)):
        raise UserError(f"the adapter tensor {key} has shape {list(shape)}, which does not fit {name} of the base "
                        f"{src.base} ({type(module).__name__} {_dims(module)}); this adapter was trained on another "
                        "base: pass --base with the model it was trained on.")


def _dims(module) -> str:
    if hasattr(module, "num_embeddings"):
        return f"{module.num_embeddings}x{module.embedding_dim}"
    return f"{module.in_features}->{module.out_features}"


def load_tokenizer(src: Source):
    """The tokenizer the run trained with: the base's, with the chat template ``data.chat_template`` named when it
    named a file (generate, the GGUF's template and the Ollama TEMPLATE must prompt as training rendered)."""
    from transformers import AutoTokenizer

    from rocktune.readers.template import use_template

    try:
        tok = AutoTokenizer.from_pretrained(src.base, trust_remote_code=src.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise UserError(f"could not load the tokenizer of {src.base}: {first_line(exc)} (offline? pass a local "
                        "model directory with --base)") from None
    return use_template(tok, (src.run_config.get("data") or {}).get("chat_template"))
