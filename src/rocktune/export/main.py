"""``rocktune export``: a run directory -> merged model, GGUF, GGUF LoRA or Ollama bundle.

Every check that can refuse (adapter present, base found and shaped like the adapter, architecture, quantisation,
target free) runs before a weight is loaded; every output is staged and renamed whole (``output.staged``).
"""

from __future__ import annotations

import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rocktune.errors import UserError
from rocktune.export import arch as archs
from rocktune.export import (gguf_lora, gguf_model, merge, next_command, ollama, output, quant, reuse, style,
                             vocab)
from rocktune.export.source import Origin, Source, load_config, load_tokenizer, resolve
from rocktune.tasks.vlm.export import gguf_vision

TARGETS = ("merged", "gguf", "gguf-lora", "ollama")


def run_export(origin: Origin, to: str, out: str | None, quant_name: str | None, dtype: str, overwrite: bool,
               with_base: bool = False, template: str = "auto") -> list[dict]:
    """Export and print one line per file written; returns [{path, bytes, seconds}]."""
    src = resolve(origin.path, origin.base, origin.trust_remote_code)
    path = origin.path
    if to in ("gguf", "ollama"):
        _check_chat_template(src)
    resolved = Path(path).resolve()
    name = resolved.parent.name if resolved.name in ("run", "adapter") else resolved.name  # runs/demo/run -> demo
    # the export goes beside adapter/, also when the adapter directory itself was given
    default = (src.adapter.parent if src.adapter == Path(path) else Path(path)) / "export"
    root = Path(out) if out else default
    t0, kept = time.perf_counter(), []
    if to == "merged":
        written = [_merged(src, root if out else root / "merged", dtype, overwrite, kept)]
    elif to == "gguf-lora":
        written = _gguf_lora(src, root, quant_name or "f32", overwrite, with_base, name, bool(out))
    else:
        q = quant_name or "f16"
        vision = _with_eyes(load_config(src.base, src.trust_remote_code))
        if vision and to == "ollama":
            written = _ollama_vision(src, root if out else root / "ollama", q, overwrite, name, template)
        elif vision:
            written = _gguf_vision(src, root if out else root / f"model-{q}.gguf", q, overwrite, name, bool(out))
        elif to == "ollama":
            written = [_gguf(_GgufJob(src, Path("model.gguf"), q, overwrite, name, _siblings(default, q), kept,
                                      root if out else root / "ollama", template))]
        else:
            written = [_gguf(_GgufJob(src, root if out else root / f"model-{q}.gguf", q, overwrite, name,
                                      _siblings(default, q), kept))]
            _notes([next_command.then(next_command.llama_argv(written[0]))])
    seconds = round(time.perf_counter() - t0, 1)
    report = [{"path": str(p), "bytes": output.size_of(p), "seconds": seconds} for p in written]
    for r in report:
        done = "kept (up to date)" if Path(r["path"]) in kept else "wrote"
        sys.stdout.write(f"{done} {r['path']} ({r['bytes'] / 2**20:.1f} MiB)\n")
    sys.stdout.write(f"export --to {to} took {seconds} s\n")
    return report


def _merged(src: Source, target: Path, dtype: str, overwrite: bool, kept: list[Path]) -> Path:
    if src.adapter is None:
        raise UserError(f"{src.base} is a model directory without an adapter: there is nothing to merge.")
    chosen = merge.base_dtype(src.base, src.trust_remote_code) if dtype == "auto" else dtype
    source = reuse.digest(src, reuse.merged_settings(chosen))
    if not overwrite and reuse.recorded_dir(target) == source:
        _notes([f"{target} is up to date (merged from this adapter and base as {chosen}): nothing written"])
        kept.append(target)
        return target
    output.check_target(target, overwrite, is_dir=True)
    sys.stderr.write(f"loading {src.base} in fp32 and merging {src.adapter}\n")
    model, notes = merge.merged_model(src, chosen)
    with output.staged(target, overwrite, is_dir=True) as tmp:
        merge.save_merged(model, load_tokenizer(src), tmp, src.base)
        reuse.record_dir(tmp, source)  # an fp32 merge is what a GGUF export loads instead of merging again
    _notes(notes)
    return target


def _fp32_model(src: Source, merged: Path | None = None):
    """The base merged with the adapter in fp32; ``merged``: an ``--to merged --dtype fp32`` directory of the same
    adapter and base, loaded instead of merging again."""
    if merged is not None and src.adapter is not None and \
            reuse.recorded_dir(merged) == reuse.digest(src, reuse.merged_settings("fp32")):
        sys.stderr.write(f"loading {merged} (merged in fp32 from this adapter and base: no merge)\n")
        return merge.load_base_fp32(str(merged), src.trust_remote_code), []
    # a 7B base takes minutes to load and merge on a CPU: say what is happening (stderr keeps stdout for results)
    sys.stderr.write(f"loading {src.base} in fp32{' and merging ' + str(src.adapter) if src.adapter else ''}\n")
    if src.adapter is None:
        return merge.load_base_fp32(src.base, src.trust_remote_code), []
    return merge.merged_model(src, "fp32")


@dataclass
class _GgufJob:
    """One GGUF file at ``path``; with ``ollama_dir``, the directory holding it (named ``path``) and a Modelfile.
    ``siblings``: where the run's other exports keep the same GGUF (reused when it carries the same digest)."""
    src: Source
    path: Path
    q: str
    overwrite: bool
    name: str
    siblings: list[Path]
    kept: list[Path]  # filled with the output when it was up to date and left as it was
    ollama_dir: Path | None = None
    template: str = "auto"


def _siblings(default: Path, q: str) -> list[Path]:
    """The GGUF files ``--to gguf`` and ``--to ollama`` write by default for ``q``: either may serve the other."""
    return [default / f"model-{q}.gguf", default / "ollama" / "model.gguf"]


def _gguf(job: _GgufJob) -> Path:
    src, path, q, ollama_dir = job.src, job.path, job.q, job.ollama_dir
    _need_gguf()
    cfg = load_config(src.base, src.trust_remote_code)
    arch = archs.arch_for(cfg)
    quant.check_quant(q, gguf_model.row_lengths(cfg))
    source = reuse.digest(src, {"gguf": q, "name": job.name})
    target, own = ollama_dir or path, (ollama_dir / path.name if ollama_dir else path)
    if not job.overwrite and reuse.recorded(own) == source:
        _notes([f"{target} is up to date (written from this adapter, base and settings): nothing written"])
        job.kept.append(target)
        return target
    output.check_target(target, job.overwrite, is_dir=ollama_dir is not None)
    found = reuse.find(source, [own, *job.siblings])
    if found is not None:
        return _reuse_gguf(job, found)
    model, notes = _fp32_model(src, job.siblings[0].parent / "merged" if job.siblings else None)
    tensors = gguf_model.gguf_tensors(model.state_dict(), model.config, arch)
    sys.stderr.write(f"writing GGUF ({q})\n")
    with output.scratch(target) as tok_dir:  # beside the output: a kill leaves nothing in the system's temp
        tokenizer = _tokenizer(src, model.config, tok_dir)
        if ollama_dir is None:
            with output.staged(path, job.overwrite, is_dir=False) as tmp:
                gguf_model.write_model_gguf(tensors, model.config, arch, tok_dir, tmp, q, job.name, source)
            _notes([n for n in notes if "tied" in n])
            return path
        with output.staged(ollama_dir, job.overwrite, is_dir=True) as tmp:
            gguf_model.write_model_gguf(tensors, model.config, arch, tok_dir, tmp / path.name, q, job.name, source)
            more = _write_modelfile(job, tmp, tokenizer, getattr(model, "generation_config", None))
    _notes(more + [f"then: ollama create {job.name} -f {ollama_dir / 'Modelfile'}"])
    return ollama_dir


def _write_modelfile(job: _GgufJob, folder: Path, tokenizer, generation_config) -> list[str]:
    text, more = ollama.modelfile(job.path.name, style.resolve_style(job.template, job.src.run_config, tokenizer),
                                  tokenizer, generation_config)
    (folder / "Modelfile").write_text(text, encoding="utf-8")
    return more


def _reuse_gguf(job: _GgufJob, found: Path) -> Path:
    """The export made of ``found``, a GGUF written from the same adapter, base and settings: no merge."""
    how = f"reused {found} (same adapter, base and settings: no merge)"
    if job.ollama_dir is None:
        with output.staged(job.path, job.overwrite, is_dir=False) as tmp:
            how += "; " + reuse.link(found, tmp)
        _notes([how])
        return job.path
    tokenizer = load_tokenizer(job.src)  # the Modelfile's template and stops: no weights needed
    with output.staged(job.ollama_dir, job.overwrite, is_dir=True) as tmp:
        how += "; " + reuse.link(found, tmp / job.path.name)
        more = _write_modelfile(job, tmp, tokenizer, reuse.generation_config(job.src))
    _notes([how, *more, f"then: ollama create {job.name} -f {job.ollama_dir / 'Modelfile'}"])
    return job.ollama_dir


@dataclass
class _VisionParts:
    """A vlm export's pieces, ready to write: the language model's tensors and config, and the projector's."""
    model: object
    text: object
    arch: archs.Arch
    tensors: dict
    projector: dict
    notes: list
    preprocessor: dict  # the image processor's normalisation and limits, with the run's data.min/max_pixels


def _with_eyes(cfg) -> bool:
    """Is this a vision-language export (the language model and its mmproj)? A multimodal checkpoint whose vision
    family llama.cpp's mmproj writer here does not know, but whose language model the text export does (Gemma 4
    as it ships: Gemma4ForConditionalGeneration), gives the language model alone, as llama.cpp's converter does for
    it, saying so; one known to neither is refused by the vision export, naming the family."""
    if not gguf_vision.is_vision(cfg):
        return False
    if gguf_vision.family_facts(getattr(cfg, "model_type", "")) is not None:
        return True
    if getattr(archs.language_config(cfg), "model_type", None) in archs.ARCHS and \
            archs.language_config(cfg) is not cfg:
        _notes([f"the {cfg.model_type} checkpoint's vision tower is left out of the GGUF (no mmproj writer for it "
                "yet): the file holds the language model the run trained, for text"])
        return False
    return True


def _check_vision(src: Source, q: str) -> tuple[archs.Arch, dict, gguf_vision.ImageTokens | None]:
    """Everything that can refuse a vlm GGUF export, before any weight is loaded: (text arch, the image processor's
    settings, its image-token limits in llama.cpp's terms)."""
    _need_gguf()
    cfg = load_config(src.base, src.trust_remote_code)
    gguf_vision.check(cfg)
    text = gguf_vision.text_config(cfg)
    quant.check_quant(q, gguf_model.row_lengths(text))
    preprocessor = _preprocessor(src)
    return archs.arch_for(text), preprocessor, gguf_vision.image_tokens(cfg, preprocessor)


def _vision_parts(src: Source, arch: archs.Arch, preprocessor: dict) -> _VisionParts:
    model, notes = _fp32_model(src)
    text_state, vision_state = gguf_vision.split_state(model.state_dict(), model.config)
    text = gguf_vision.text_config(model.config)  # the merge may have untied the head
    return _VisionParts(model, text, arch, gguf_model.gguf_tensors(text_state, text, arch),
                        gguf_vision.mmproj_tensors(vision_state, model.config), [n for n in notes if "tied" in n],
                        preprocessor)


def _write_vision(parts: _VisionParts, src: Source, tok_dir: Path, paths: tuple[Path, Path], q: str, name: str):
    """The language model and its mmproj at ``paths``; returns the tokenizer (with the processor's template)."""
    sys.stderr.write(f"writing GGUF ({q}) and its vision projector ({gguf_vision.mmproj_type(q)})\n")
    tokenizer = _tokenizer(src, parts.model.config, tok_dir)
    gguf_model.write_model_gguf(parts.tensors, parts.text, parts.arch, tok_dir, paths[0], q, name)
    gguf_vision.write_mmproj(parts.projector, parts.model.config, parts.preprocessor, paths[1],
                             gguf_vision.mmproj_type(q), name + "-mmproj")
    return tokenizer


def _gguf_vision(src: Source, path: Path, q: str, overwrite: bool, name: str, explicit: bool,
                 lora: Path | None = None) -> list[Path]:
    """task=vlm: the language model at ``path`` and its vision projector (mmproj) beside it, as llama.cpp loads them
    (llama-mtmd-cli / llama-server -m MODEL --mmproj MMPROJ); ``lora``: the adapter the printed command applies to
    this model (gguf-lora --with-base writes the base here, which alone is the untrained model)."""
    arch, preprocessor, tokens = _check_vision(src, q)
    mq = gguf_vision.mmproj_type(q)
    mmproj = path.with_name(f"mmproj-{path.name}" if explicit else f"mmproj-{mq}.gguf")
    for target in (path, mmproj):
        output.check_target(target, overwrite, is_dir=False)
    parts = _vision_parts(src, arch, preprocessor)
    with output.scratch(path) as tok_dir:
        with output.staged(path, overwrite, is_dir=False) as tmp, output.staged(mmproj, overwrite, False) as mtmp:
            tokenizer = _write_vision(parts, src, tok_dir, (tmp, mtmp), q, name)
    _notes(parts.notes + gguf_vision.tokenizer_notes(parts.model.config, tokenizer) + _token_notes(tokens) +
           [next_command.then(next_command.llama_argv(path, lora, mmproj, tokens))])
    return [path, mmproj]


def _token_notes(tokens: gguf_vision.ImageTokens | None) -> list[str]:
    return [tokens.note()] if tokens and tokens.note() else []


def _ollama_vision(src: Source, ollama_dir: Path, q: str, overwrite: bool, name: str, template: str) -> list[Path]:
    """task=vlm for Ollama: both GGUF files and a Modelfile naming both (two FROM lines: Ollama keeps a GGUF of
    type mmproj as the model's projector and runs it with llama.cpp's --mmproj)."""
    arch, preprocessor, tokens = _check_vision(src, q)
    output.check_target(ollama_dir, overwrite, is_dir=True)
    parts = _vision_parts(src, arch, preprocessor)
    with output.scratch(ollama_dir) as tok_dir, output.staged(ollama_dir, overwrite, is_dir=True) as tmp:
        tokenizer = _write_vision(parts, src, tok_dir, (tmp / "model.gguf", tmp / "mmproj.gguf"), q, name)
        text, more = ollama.modelfile("model.gguf", style.resolve_style(template, src.run_config, tokenizer),
                                      tokenizer, getattr(parts.model, "generation_config", None),
                                      projector_name="mmproj.gguf")
        (tmp / "Modelfile").write_text(text, encoding="utf-8")
    _notes(parts.notes + gguf_vision.tokenizer_notes(parts.model.config, tokenizer) + more +
           _token_notes(tokens) + _ollama_token_notes(tokens, ollama_dir) +
           [f"then: ollama create {name} -f {ollama_dir / 'Modelfile'}"])
    return [ollama_dir]


def _ollama_token_notes(tokens: gguf_vision.ImageTokens | None, ollama_dir: Path) -> list[str]:
    """Ollama's runner starts llama-server for Qwen-VL models with a fixed --image-min-tokens 1024 (its
    llm/llama_server.go) and a Modelfile has no parameter for the image tokens: say what that changes."""
    if tokens is None:
        return []
    argv = ["llama-server", "-m", str(ollama_dir / "model.gguf"), "--mmproj", str(ollama_dir / "mmproj.gguf"),
            *tokens.flags()]
    return [f"Ollama runs Qwen-VL models with at least 1024 image tokens an image (a Modelfile cannot change it); "
            f"this model trained on {tokens.low} to {tokens.high}, so Ollama enlarges smaller images and may answer "
            f"otherwise than the run. For the trained resolution: {shlex.join(argv)}"]


def _preprocessor(src: Source) -> dict:
    """The base's image normalisation and size limits, which the mmproj and the printed command carry for llama.cpp's
    own preprocessing: with the run's data.min_pixels / data.max_pixels, as training loaded the processor."""
    from transformers import AutoImageProcessor

    from rocktune.tasks.vlm.vision.families import processor_pixels, size_of

    data = src.run_config.get("data") or {}
    limits = {k: data[k] for k in ("min_pixels", "max_pixels") if data.get(k) is not None}
    proc = AutoImageProcessor.from_pretrained(src.base, **limits)
    # Idefics3/SmolVLM's longest_edge: the side an image is resized to before tiling; Qwen's pixel limits as the
    # adapter card reads them too (tasks/vlm/vision/families.py: processor_pixels)
    return {"image_mean": list(proc.image_mean), "image_std": list(proc.image_std),
            "longest_edge": size_of(getattr(proc, "size", None), "longest_edge"), **processor_pixels(proc)}


def _gguf_lora(src: Source, root: Path, dtype: str, overwrite: bool, with_base: bool, name: str,
               explicit: bool) -> list[Path]:
    if src.adapter is None:
        raise UserError(f"{src.base} is a model directory without an adapter: there is no LoRA to export.")
    if dtype not in ("f32", "f16"):
        raise UserError(f"--quant {dtype}: a GGUF LoRA is written as f32 (default) or f16.")
    _need_gguf()
    cfg = load_config(src.base, src.trust_remote_code)
    vision = _with_eyes(cfg)
    family = gguf_lora.TEXT
    if vision:  # the language model's LoRA; the base's mmproj (--with-base writes it) sees as before
        family = gguf_vision.check(cfg)
        cfg = gguf_vision.text_config(cfg)
    arch = archs.arch_for(cfg)
    path = root if explicit and root.suffix == ".gguf" else root / f"adapter-{dtype}.gguf"
    output.check_target(path, overwrite, is_dir=False)
    tensors, alpha = gguf_lora.lora_tensors(src.adapter, cfg, arch, family)
    written = []
    if with_base:
        # the run's config goes with the base: its chat template and pixel limits are what the LoRA trained with
        base_src = Source(src.base, None, src.run_config, src.trust_remote_code)
        base_path = path.with_name("base-f16.gguf")
        written += _gguf_vision(base_src, base_path, "f16", overwrite, name + "-base", True, lora=path) if vision \
            else [_gguf(_GgufJob(base_src, base_path, "f16", overwrite, name + "-base", [], []))]
    with output.staged(path, overwrite, is_dir=False) as tmp:
        gguf_lora.write_lora_gguf(tensors, alpha, arch, tmp, dtype, name)
    if not with_base:
        _notes([_lora_hint(src, path, vision)])
    elif not vision:
        _notes([next_command.then(next_command.llama_argv(written[0], path))])
    return [path, *written]


def _lora_hint(src: Source, adapter: Path, vision: bool) -> str:
    """The command without --with-base: the base as GGUF is the user's (named by a placeholder), the LoRA ours."""
    base = "BASE.gguf"
    if not vision:
        return next_command.then(next_command.llama_argv(base, adapter)) + f"; {base}: the base {src.base} as GGUF " \
            "(--with-base writes it)"
    tokens = gguf_vision.image_tokens(load_config(src.base, src.trust_remote_code), _preprocessor(src))
    return next_command.then(next_command.llama_argv(base, adapter, "MMPROJ-BASE.gguf", tokens)) + \
        f"; {base} and MMPROJ-BASE.gguf: the base {src.base} and its mmproj as GGUF (--with-base writes them)"


def _tokenizer(src: Source, model_config, tok_dir: Path):
    """Save the base's tokenizer and the model config where gguf-py's vocabulary helpers read them."""
    tok = load_tokenizer(src)
    if gguf_vision.is_vision(model_config):  # task=vlm: the processor's chat template (image parts) goes in the GGUF
        from rocktune.tasks.vlm.vision.model import with_processor_template

        tok = with_processor_template(tok, src.base)
    tok.save_pretrained(tok_dir)
    model_config.save_pretrained(tok_dir)
    _copy_sentencepiece_model(src.base, tok_dir)
    _copy_shipped_tokenizer_json(src.base, tok_dir)
    return tok


def _check_chat_template(src: Source) -> None:
    """The GGUF carries the base's chat template and the Modelfile is derived from it: a template the sandbox
    refuses is refused here, before minutes of merging and before anything is written."""
    from rocktune.readers.template import check_chat_template

    try:
        tok = load_tokenizer(src)
    except UserError as exc:
        if "could not load the tokenizer" in str(exc):
            return  # said with its fix where the tokenizer is loaded for the export
        raise
    check_chat_template(tok)


def _copy_sentencepiece_model(base: str, tok_dir: Path) -> None:
    """transformers 5 no longer saves tokenizer.model; SentencePiece vocabularies (scores included) come from it."""
    import shutil

    from transformers.utils import cached_file

    found = cached_file(base, "tokenizer.model", _raise_exceptions_for_missing_entries=False,
                        _raise_exceptions_for_connection_errors=False)
    if found and not (tok_dir / "tokenizer.model").exists():
        shutil.copyfile(found, tok_dir / "tokenizer.model")


def _copy_shipped_tokenizer_json(base: str, tok_dir: Path) -> None:
    """The tokenizer.json the base ships, beside the re-saved one: transformers 5 rebuilds some tokenizers from their
    class (SmolLM2's GPT2Tokenizer loses its Digits step on save), and the GGUF's pre-tokenizer name must describe
    the splitting the model was trained with, as llama.cpp's own converter reads it from this file."""
    import shutil

    from transformers.utils import cached_file

    found = cached_file(base, "tokenizer.json", _raise_exceptions_for_missing_entries=False,
                        _raise_exceptions_for_connection_errors=False)
    if found:
        shutil.copyfile(found, tok_dir / vocab.SHIPPED_TOKENIZER)


def _need_gguf() -> None:
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        raise UserError("GGUF export needs the gguf package (ggml-org's gguf-py): pip install 'rocktune[gguf]'.")


def _notes(notes: list[str]) -> None:
    for n in notes:
        sys.stdout.write(f"note: {n}\n")
