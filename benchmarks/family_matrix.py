"""The family matrix in the README and docs/families.md, generated from tests/test_families.py's results.

    python benchmarks/family_matrix.py            # run the matrix tests (minutes), record, write the docs
    python benchmarks/family_matrix.py --render   # rewrite the docs from the recorded docs/families.json

Each cell is one test, ``tests/test_families.py::test_<column>[<family>]``; its outcome comes from pytest's JUnit XML
report (a skip carries its reason; a refusal the command must make is a passing test that records what it refused
with ``record_property("cell", ...)``). tests/test_family_matrix.py checks that the README and docs/families.md are
what this script renders from the recorded results, so neither can be edited by hand out of step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "families.json"
DOC = ROOT / "docs" / "families.md"
README = ROOT / "README.md"
START, END = "<!-- family-matrix:start -->", "<!-- family-matrix:end -->"
# (column heading, test function): the order of the table
COLUMNS = [("LoRA targets (all-linear)", "test_lora_targets"), ("chat masking", "test_chat_masking"),
           ("train", "test_train"), ("QLoRA", "test_qlora"), ("merged", "test_merged"), ("GGUF", "test_gguf"),
           ("GGUF-LoRA", "test_gguf_lora"), ("Ollama", "test_ollama"), ("llama.cpp", "test_llama_cpp"),
           ("plan", "test_plan")]
TEST_FILE = "tests/test_families.py"
QUIRKS = [
    "- **Gemma 2 / Gemma 3**: the (1 + w) RMSNorm, the embedding scaled by the square root of the width, logit "
    "soft-capping and sliding windows live inside transformers' model code; the merged check (logits equal the "
    "PEFT model's) covers them. Gemma 2's transformers class has no SDPA path, so `model.attn_implementation: "
    "auto` loads it with eager attention (a note says so) instead of failing. Gemma's template has no system "
    "role.",
    "- **Phi-3 / Phi-4**: attention and MLP input projections are fused (`qkv_proj`, `gate_up_proj`); LoRA adapts"
    " them as they are, one adapter across q, k and v (and across gate and up).",
    "- **Qwen3-MoE / Mixtral**: transformers 5 stores each layer's experts as 3-D parameters; `all-linear` adapts"
    " attention by name and the experts through PEFT's parameter targeting; the router is left alone (PEFT's own "
    "all-linear would adapt it, and a moved router sends tokens to experts the adapter did not train for them).",
    "- **Granite 3**: embedding, residual, attention and logit multipliers are config values the merged model "
    "keeps; the GGUF carries them as llama.cpp's granite scales.",
    "- **GGUF per family** (facts from llama.cpp's converter and loader): Gemma's norms are stored as 1 + w, with"
    " attention/final soft-capping, the sliding window and its per-layer pattern (Gemma 3: the local rope base); "
    "a query scale llama.cpp would not use is refused. Phi-3's fused `qkv_proj`/`gate_up_proj` stay fused "
    "(`attn_qkv`, `ffn_up`), and so do their LoRAs. OLMo 2's loader has no tied head, so `output.weight` is "
    "always written. SmolLM3 is refused unless rope is skipped in every 4th layer, the rule llama.cpp hard-codes."
    " Qwen3-MoE and Mixtral experts become `ffn_{gate,up,down}_exps` stacks and their LoRAs per-expert LoRAs; "
    "Qwen3-MoE without `norm_topk_prob` (llama.cpp always renormalises) is refused. Granite 4 "
    "(`export/granite_hybrid.py`): transformers 5 saves its layer kinds as `linear_attention`/`full_attention`, "
    "the released config.json and llama.cpp's converter say `mamba`/`attention`; rocktune reads both, writes rope "
    "only where the config asks for it (the released hybrids have no positions), a dense hybrid's MLP width from "
    "`shared_intermediate_size` (the converter's `intermediate_size` gives a file llama.cpp cannot load when they "
    "differ), and refuses Mamba settings llama.cpp's graph hard-codes otherwise (expansion 2, no projection "
    "biases, no time-step clamp). Gemma 4 (`export/gemma4.py`): both head widths, proportional rope as "
    "`rope_freqs`, per-layer embeddings, the KV-sharing tail; its GGUF LoRA refuses an adapter on "
    "`per_layer_model_projection` (llama.cpp's graph multiplies it without a LoRA: it would be dropped silently), "
    "so the matrix's all-linear adapter is a refused cell and an adapter without it runs in llama.cpp as the "
    "merged model (`tests/test_gguf_variants.py`); Gemma 4's MoE (26B-A4B) is refused. gpt-oss's released MXFP4 "
    "experts are written as the checkpoint's own MXFP4 blocks where the adapter left them alone (equal to the "
    "converter's file), unquantised where a merged expert LoRA changed them (docs/moe.md).",
    "- **Tied embeddings** (Qwen2.5 small, Qwen3 small, SmolLM2/3, Granite, Gemma): the head stays tied unless "
    "the adapter changed it (docs/export.md).",
    "- **Chat templates**: every family's template shape is exercised by `test_chat_masking` (with a system turn "
    "where the template takes one; Mistral's and Gemma 2/3's have none). SmolLM3's row uses a template with `{% "
    "generation %}` markers: rocktune finds the reply by rendering the template turn by turn, and the tokens it "
    "trains are exactly the ones the markers enclose. Every template, the released ones under "
    "`tests/data/templates/` included, is encoded on conversations of 1, 2 and 4 turns with and without a system "
    "turn, a tool call and reasoning (`tests/test_chat_multiturn.py`): the tokens equal the template's rendering, "
    "every reply is trained and nothing else. Phi-3.5's past replies end `<|end|>\\n` (taken in whole tokens; "
    "before, its `<|` was cut into the reply as text).",
    "- **LoRA targets by role** (`src/rocktune/models/targets.py`): `all-linear` adapts every linear layer but "
    "the head, whatever the layer kind: attention, Gated DeltaNet's `in_proj_*`/`out_proj` (Qwen3.5, Qwen3-Next),"
    " Mamba2's `in_proj`/`out_proj` and the shared MLP (Granite 4), dense-layer MLPs and shared experts (GLM-4.5,"
    " Llama 4, Qwen3.5-MoE), Gemma 4's per-layer projections. Never a router (the child of an expert-stack block "
    "with one output per expert, whatever its class: Llama 4's is an `nn.Linear` returning a tuple, which crashed"
    " the first step when adapted) nor a 1-wide gate (Qwen3.5-MoE's and Qwen3-Next's `shared_expert_gate`). The "
    "run log's `lora targets:` line lists what was adapted and left out, by kind. PEFT 0.21 rewrites a config's "
    "`gate_proj`/`up_proj`/`down_proj` targets onto the fused experts for models on Qwen2-MoE's v4 pattern "
    "(GLM-4.5, Qwen3-Next), dropping their dense MLPs and shared experts; rocktune keeps a target that names a "
    "real linear layer (`keep_v5_names`), in training and when an adapter is loaded for export. A plain PEFT load"
    " of such an adapter outside rocktune still applies the rewrite.",
    "- **Recurrent layers** (Qwen3.5, Qwen3-Next: Gated DeltaNet; Granite 4: Mamba2): packed rows are refused "
    "(`data.packing`, `training.batching: tokens`) because the layer's state runs on from one packed example into"
    " the next; `batching: auto` keeps padded micro-batches for them. Their kernels: transformers 5 picks "
    "flash-linear-attention's (Gated DeltaNet), causal-conv1d's (the short convolution) and mamba-ssm's (Mamba2) "
    "where they import; rocktune keeps each only where it passes a self-test on the device after loading "
    "(`kernels/recurrent.py`: the layer's own call, forward and backward, against transformers' torch function, "
    "once per process, device and dtype), runs transformers' torch function for the others and on the CPU, and "
    "says which and why in the run log (`kernels: recurrent layers on cuda:0 (bfloat16): ...`). Mamba2's fused "
    "training kernel (`mamba_split_conv1d_scan_combined`) never runs: it reads `out_proj`'s weight itself, under "
    "PEFT the frozen base, so the LoRA on `out_proj` would learn nothing (`tests/test_training_matrix.py` shows "
    "it); the layer runs the separate kernels instead. `rocktune doctor` self-tests each kernel family "
    "(`recurrent[gated_deltanet|causal_conv1d|mamba2,dtype]`), and the run's tripwire compares the path with the "
    "torch functions at its first steps, naming a kernel that passed at load and computes other values on the "
    "run's batch. A model loaded on the CPU for FSDP runs the torch functions (nothing was proven on its GPU); "
    "task=vlm's loader does not choose yet (transformers' pick runs there unproven). Without the packages "
    "transformers runs its torch reference kernels (the run log says so): a 4-layer hidden-64 Granite 4 with the "
    "matrix fixture's Mamba2 settings (4 heads of 32, state 16, chunk 16) takes 0.05 s per forward and backward "
    "of 8 x 96 tokens on one CPU thread, the same model with transformers' default Mamba2 settings (128 heads of "
    "width 1, state 256, chunk 256 > the sequence) 26 s, about 500 times as long (`OMP_NUM_THREADS=1 python "
    "benchmarks/mamba_reference_scan.py`, best of two steps; 0.3 s and 80 s on the same shared machine under "
    "load): the reference scan costs chunk^2 x heads x state whatever the sequence length. Real Granite 4 shapes "
    "are of the first kind.",
    "- **gpt-oss (Harmony)** (the matrix uses its released template, "
    "`tests/data/templates/openai-gpt-oss-120b.jinja`): a reply's reasoning (`thinking` or `reasoning_content`) "
    "renders on the analysis channel as a message of its own before the final answer; it is prompt, not loss: the"
    " final channel and tool calls (`to=functions.NAME` on the commentary channel) are trained. The template "
    "drops a tool call's analysis once a final answer follows; such a call is located as the whole conversation "
    "renders it. Harmony's system header (with the date) is 236 tokens on the matrix's byte-level tokenizer, and "
    "its conversations up to 312, so the matrix trains it with `max_length` 320. In a conversation of several "
    "turns a past final answer ends with `<|end|>` and the last with `<|return|>`: the past answer's text is "
    "trained, its `<|end|>` is prompt (the model writes `<|return|>`, which a client rewrites for the history; "
    "nothing stops on `<|end|>`). Before, every Harmony conversation of more than one turn was refused. The "
    "released weights' MXFP4 experts are dequantised for LoRA (exactly: the run log states the memory it costs; "
    "`rocktune plan` counts it; docs/moe.md).",
    "- **Qwen3.5 thinking blocks** (the matrix uses its released template, "
    "`tests/data/templates/Qwen-Qwen3.5-4B.jinja`): every reply after the last user query renders in a think "
    "block (empty without reasoning) and the generation prompt opens it (`<think>\\n`), so such a reply is trained"
    " from inside the block, as the model continues at inference; replies before that query render without one "
    "and are trained from their text, their `reasoning_content` dropped as the template drops it (reasoning "
    "inside an earlier turn's `content` is refused: the template would cut the text). An agent trace followed by "
    "a later query is located as the whole conversation renders it (a prefix that ends inside it still shows its "
    "think blocks). Tool calls train in its XML syntax (`<tool_call>\\n<function=NAME>` with `<parameter=KEY>` "
    "blocks). Before this, every multi-turn conversation on the released template was refused as not "
    "prefix-consistent.",
    "- **GLM-4.5**: its template writes nothing after a reply: the model ends a reply by writing the next turn's "
    "role token, `<|user|>` (or `<|observation|>` after a tool call), and its generation config stops on both. "
    "rocktune trains that token as the reply's end: the one the template writes right after the reply (found by "
    "rendering a probe reply with a user turn, and a probe call with a tool result, after it), and after the "
    "conversation's last reply, where the template writes nothing, it appends it (`<|user|>`; `<|observation|>` "
    "after a call), so the tokens are the template's rendering plus that one token. Only a token the model stops "
    "on (the tokenizer's EOS and the `eos_token_id` of the model's `generation_config.json` / `config.json`) is "
    "used: generation then stops there in transformers, `rocktune generate`, llama.cpp (the GGUF names `<|user|>`"
    " its end of turn and `<|observation|>` its end of message) and Ollama (both are stops in the Modelfile). A "
    "template that writes nothing the model stops on is still refused before training (`stop-never-trained`, "
    "naming the token it opens the next turn with and the model's stops). Tool calls train in GLM's XML syntax "
    "(`<tool_call>NAME` then `<arg_key>`/`<arg_value>` pairs); a reply's `reasoning_content` is kept in its think"
    " block only after the last user turn, as the template does (`tests/test_family_chat.py`, on the fixture's "
    "shape and on GLM-4.6's released template, which 4.5 shares). Such conversations are rendered per prefix (the"
    " one-rendering layout does not apply).",
    "- **Llama 4**: its text model keeps the decoder as `model` while its `base_model_prefix` says "
    "`language_model`; rocktune's loss finds it (the first step failed before).",
    "- **Gemma 4**: per-layer embeddings (`hidden_size_per_layer_input` per layer and token) are adapted through "
    "their projections (`per_layer_input_gate`, `per_layer_projection`, `per_layer_model_projection`); the "
    "embedding table itself is frozen like every embedding. Its released template's generation prompt opens an "
    "empty thought channel (`<|channel>thought\\n<channel|>`) that a reply in the history does not have: replies "
    "are trained from after the turn header, as rendered (every chat conversation on that template was refused as"
    " not prefix-consistent before); a tool call is trained up to the `<|tool_response>` that opens its result "
    "inside the model's turn (`tests/test_family_chat.py`; the matrix row keeps a shape of Gemma 4's turns).",
    "- **Multimodal releases** (Qwen3.5, Llama 4 and Gemma 4 ship with a vision tower): a text task loads "
    "Qwen3.5's and Llama 4's as their causal LM with the language model's own weights "
    "(`tests/test_family_checkpoints.py`: logits equal); Gemma 4's loads as `Gemma4ForConditionalGeneration`, "
    "whose vision tower and projector `all-linear` leaves out (`tests/test_lora_targets.py`); `export --to "
    "gguf` of such a run writes its language model alone, saying the vision tower is left out (no mmproj writer "
    "for Gemma 4 yet). Qwen3.5 with its vision tower trains under `task: vlm` and exports with its mmproj "
    "(docs/vision.md).",
    "- **QLoRA on the CPU**: bitsandbytes' CPU nf4 is wrong on rows of 32 and the QLoRA gate refuses such a "
    "model; the matrix's MoE expert widths are 64.",
]


def parse_junit(xml_text: str) -> dict[str, dict]:
    """JUnit XML -> {test id: {"outcome": passed|skipped|failed, "reason"?: str, "cell"?: str}}."""
    out = {}
    for case in ET.fromstring(xml_text).iter("testcase"):
        row: dict = {"outcome": "passed"}
        for child in case:
            if child.tag == "skipped":
                row = {"outcome": "skipped", "reason": _skip_reason(child.get("message") or "")}
            elif child.tag in ("failure", "error"):
                row = {"outcome": "failed", "reason": (child.get("message") or child.tag).splitlines()[0][:200]}
        for prop in case.iter("property"):
            if prop.get("name") == "cell":
                row["cell"] = prop.get("value")
        out[case.get("name")] = row
    return out


def _skip_reason(message: str) -> str:
    # pytest prefixes the reason with where the skip was raised ("Skipped: ..." or "file:line: ...")
    return message.removeprefix("Skipped: ").strip()


def families(results: dict[str, dict]) -> list[str]:
    """The families in the order the tests ran them (the fixture table's order)."""
    seen: list[str] = []
    for key in results:
        name = key.split("[", 1)[1].rstrip("]") if "[" in key else None
        if name and name not in seen:
            seen.append(name)
    return seen


def cell(row: dict | None) -> tuple[str, str | None]:
    """(the table's text, the note for the notes list or None)."""
    if row is None:
        return "–", "no recorded result"
    if row["outcome"] == "failed":
        return "FAILS", row.get("reason")
    if row["outcome"] == "skipped":
        return "not run", row.get("reason")
    text = row.get("cell")
    if text and text.startswith("refused"):
        return "refused", text
    return (text or "yes"), None


def render_table(results: dict[str, dict]) -> str:
    heads = [h for h, _ in COLUMNS]
    lines = ["| family | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
    notes: dict[str, int] = {}
    for fam in families(results):
        cells = []
        for _, test in COLUMNS:
            text, note = cell(results.get(f"{test}[{fam}]"))
            if note:
                number = notes.setdefault(note, len(notes) + 1)
                text = f"{text} ({number})"
            cells.append(text)
        lines.append(f"| {fam} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"- ({n}) {note}" for note, n in notes.items()]
    lines.append("")
    lines.append(f"Each cell is the test `{TEST_FILE}::<test>[<family>]` of its column ("
                 + ", ".join(f"{h}: `{t}`" for h, t in COLUMNS) + "); generated by `benchmarks/family_matrix.py` "
                 "from `docs/families.json`.")
    return "\n".join(lines)


def render_doc(results: dict[str, dict]) -> str:
    """docs/families.md: the table and every cell that is not a plain pass, with its test id and reason."""
    rows = [f"| `{TEST_FILE}::{key}` | {row['outcome']} | {row.get('reason') or row.get('cell') or ''} |"
            for key, row in results.items() if row["outcome"] != "passed" or (row.get("cell") or "").startswith("r")]
    return "\n".join([
        "# Model families", "",
        "Which model families rocktune trains, merges and exports, proven on a tiny random model of each family's "
        "real transformers architecture with a tokenizer carrying the family's chat-template shape "
        "(`tests/family_fixtures.py`). This page and the README's table are generated by "
        "`benchmarks/family_matrix.py` from the recorded test results in `docs/families.json`; do not edit them "
        "by hand.", "",
        render_table(results), "",
        "## Cells that are not a plain pass", "",
        "| test | outcome | why |", "|---|---|---|", *rows, "",
        "## What the columns check", "",
        "- **LoRA targets**: the modules `lora.target_modules: all-linear` adapts in every layer kind (Phi-3's "
        "fused `qkv_proj`/`gate_up_proj` as they are; on MoE models also every expert's weights through PEFT's "
        "parameter targeting), never a router or a 1-wide gate; PEFT reloads the saved adapter with the same set.",
        "- **chat masking**: only the assistant reply (with what the template writes ahead of its text: Qwen3.5's "
        "think block, Harmony's final-channel header), the family's end-of-turn token and the template's whitespace "
        "after it bear loss; the tokens equal the template's own rendering (`tests/test_family_chat.py`: Harmony "
        "channels and tool calls, Qwen3.5 thinking, Gemma 4 and Llama 4 tool calls).",
        "- **train / QLoRA**: a few steps of the real `rocktune train` on chat data (QLoRA: an nf4 base).",
        "- **merged**: `export --to merged` reloads in transformers with the PEFT model's logits (fp32, 1e-5; "
        "3e-5 on Gated DeltaNet models, whose chunked recurrence accumulates the rounding).",
        "- **GGUF**: the file is read back with gguf-py's `GGUFReader`: the family's own metadata keys, and every "
        "tensor equal to the merged weights in llama.cpp's layout (derived in the test itself: q/k rows "
        "interleaved for llama-style rope, Gemma's norms as 1 + w, MoE experts as gate/up/down stacks), exactly "
        "in f32 and to rounding in f16. For an architecture the GGUF export does not know, the command refuses "
        "with a UserError naming the architecture and writes nothing.",
        "- **GGUF-LoRA**: an A/B pair per adapted projection (per expert stack on MoE), and alpha / r · B·A equal to "
        "the merged tensor minus the base's, expert by expert.",
        "- **Ollama**: `model.gguf` and a Modelfile with the family's TEMPLATE and its end-of-turn token as a stop "
        "(the TEMPLATEs are checked against the Hugging Face rendering in `tests/test_ollama_templates.py`).",
        "- **llama.cpp**: llama.cpp itself (llama-cpp-python) loads the family's f32 GGUF, tokenises like "
        "transformers and continues a prompt greedily with the merged transformers model's 16 tokens; the base's "
        "GGUF with the GGUF LoRA gives the same tokens, and without it the base's. Skipped where llama-cpp-python "
        "is not installed (`make llama-cpp`).",
        "- **plan**: `rocktune plan` reads the family's config.json; its parameter count equals the model's (MoE: "
        "total and active) and its LoRA count equals PEFT's; an architecture it does not know is refused naming "
        "it.", "",
        "## Family quirks, and where they are handled", "",
        *QUIRKS, "",
    ])


def splice(readme: str, table: str) -> str:
    if START not in readme or END not in readme:
        raise SystemExit(f"README.md lacks the markers {START} / {END}")
    head, rest = readme.split(START, 1)
    return f"{head}{START}\n{table}\n{END}{rest.split(END, 1)[1]}"


def run_tests() -> dict[str, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
        subprocess.run([sys.executable, "-m", "pytest", TEST_FILE, "-q", "-p", "no:cacheprovider",
                        f"--junitxml={report}", "-o", "junit_family=xunit1"], cwd=ROOT, env=env, check=False)
        return parse_junit(report.read_text(encoding="utf-8"))


def write(results: dict[str, dict]) -> None:
    DOC.write_text(render_doc(results), encoding="utf-8")
    README.write_text(splice(README.read_text(encoding="utf-8"), render_table(results)), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--render", action="store_true", help="only re-render from docs/families.json")
    args = parser.parse_args(argv)
    if not args.render:
        RESULTS.write_text(json.dumps(run_tests(), indent=1) + "\n", encoding="utf-8")
    write(json.loads(RESULTS.read_text(encoding="utf-8")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
