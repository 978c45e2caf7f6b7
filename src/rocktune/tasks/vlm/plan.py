"""The planner's view of a vision-language run (``rocktune plan --task vlm``, ``train --auto`` with task=vlm): the
tokens each image makes by the model's own image processor (its smart resize under min/max_pixels, asked through
``get_number_of_image_patches``), from the data's images when a data file is given (read and checked as training
reads them, then each image's size from its header) or from an assumed image size, and the micro-batch those give
the planner (``tasks/vlm/planner/vlm.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from rocktune.data.encode import IGNORE
from rocktune.tasks.vlm.data.images import size
from rocktune.tasks.vlm.data.vision import VisionExample, VisionTokens
from rocktune.tasks.vlm.data.vision_rules import PatchGrid, SplitTiles
from rocktune.errors import UserError


@dataclass(frozen=True)
class Conversation:
    """What the planner needs of one conversation: its tokens other than image tokens, the ones that carry loss, and
    its images' stored sizes (width, height)."""

    text_tokens: int
    loss_tokens: int
    images: tuple[tuple[int, int], ...]


def from_examples(examples: list[VisionExample], vision: VisionTokens) -> list[Conversation]:
    out = []
    for k, e in enumerate(examples):
        image_tokens = e.image_tokens
        sizes = tuple(size(ref, f"conversation {k + 1}, image {i + 1}") for i, ref in enumerate(e.images))
        out.append(Conversation(len(e.input_ids) - image_tokens, sum(x != IGNORE for x in e.labels[1:]), sizes))
    return out


def assumed(text_tokens: int, image: tuple[int, int], images: int) -> list[Conversation]:
    """One conversation standing for all (no data file): ``images`` images of ``image`` pixels and ``text_tokens``
    other tokens, every one counted as trained (the planner's upper bound)."""
    if min(text_tokens, images, *image) < 1:
        raise UserError("--text-tokens, --images and --image-size must be positive.")
    return [Conversation(text_tokens, text_tokens, (image,) * images)]


class DataSizes:
    """``(max_pixels, micro_batch) -> (tokens of the longest conversation, patches of each image of the heaviest
    micro-batch, the most loss-bearing tokens of a conversation)``: the ``Sizes`` the planner's fit asks for. The
    heaviest micro-batch is taken whole: the ``micro_batch`` conversations with the most patches, at the longest
    conversation's length (rows are padded). ``shape``: the vision tower's (tasks/vlm/planner/vlm.py), for the patches
    of a view where the resolution is the processor's own (Gemma 3, Idefics3, SmolVLM: ``max_pixels`` is not used)."""

    def __init__(self, conversations: list[Conversation], vision: VisionTokens, limits: tuple[int, int], shape):
        if not conversations:
            raise UserError("no conversation to plan for: the data file is empty.")
        self.conversations, self.vision, self.shape = conversations, vision, shape
        self.max_length, self.min_pixels = limits
        self._patches = lru_cache(maxsize=None)(self._count)

    def _count(self, width: int, height: int, max_pixels: int) -> int:
        """The patches the tower sees for one image, by the image processor's own logic."""
        rule, processor = self.vision.rule, self.vision.image_processor
        if isinstance(rule, PatchGrid):  # Qwen's smart resize under min/max_pixels
            return int(processor.get_number_of_image_patches(
                height, width, {"min_pixels": self.min_pixels, "max_pixels": max_pixels}))
        if isinstance(rule, SplitTiles):  # rows x cols tiles and the global view, or the global view alone
            views = processor.get_number_of_image_patches(height, width, {})[0]
            return max(1, int(views)) * self.shape.view_patches
        return self.shape.view_patches  # Gemma 3: every image resized to the tower's one size

    def per_conversation(self, max_pixels: int) -> list[tuple[int, tuple[int, ...]]]:
        """(tokens, patches of each image) of every conversation at ``max_pixels``."""
        merge = self.shape.merge**2  # patches a token
        out = []
        for c in self.conversations:
            patches = tuple(self._patches(w, h, max_pixels) for w, h in c.images)
            out.append((min(self.max_length, c.text_tokens + sum(patches) // merge), patches))
        return out

    def __call__(self, max_pixels: int, micro_batch: int) -> tuple[int, tuple[int, ...], int]:
        rows = self.per_conversation(max_pixels)
        heaviest = sorted(rows, key=lambda r: sum(r[1]), reverse=True)[:micro_batch]
        patches = tuple(p for _, ps in heaviest for p in ps)
        if len(rows) == 1:  # an assumed conversation stands for every row
            patches = rows[0][1] * micro_batch
        return max(n for n, _ in rows), patches, max(c.loss_tokens for c in self.conversations)

    def check_length(self, max_pixels: int) -> None:
        """An assumed conversation whose images alone reach max_length: training would refuse it (a cut through an
        image's tokens), so the plan does too. (A data file's rows were encoded, and so checked, already.)"""
        merge = self.shape.merge**2
        for c in self.conversations:
            image_tokens = sum(self._patches(w, h, max_pixels) for w, h in c.images) // merge
            if image_tokens >= self.max_length:
                at = f"at max_pixels={max_pixels}" if max_pixels else "at the processor's resolution"
                lower = " or lower --max-pixels" if max_pixels else ""
                raise UserError(f"{len(c.images)} image(s) of {c.images[0][0]}x{c.images[0][1]} make {image_tokens} "
                                f"tokens {at}, not fewer than --max-length={self.max_length}: training would refuse "
                                f"the conversation (a cut through an image); raise --max-length{lower}.")

    def describe(self, max_pixels: int) -> dict:
        rows = self.per_conversation(max_pixels)
        merge = self.shape.merge**2
        tokens = [p // merge for _, ps in rows for p in ps]
        longest = max(rows, key=lambda r: r[0])
        stored: list[tuple[int, int]] = [s for c in self.conversations for s in c.images]
        return {"conversations": len(rows), "images": len(tokens), "max_pixels": max_pixels or None,
                "min_pixels": self.min_pixels if max_pixels else None, "pixels_per_token": self.shape.patch**2 * merge,
                "tokens_per_image": {"min": min(tokens, default=0), "max": max(tokens, default=0)},
                # mypy takes the key's argument from list()'s Iterable context: ignored below
                "image_sizes": {"smallest": list(min(stored, key=lambda s: s[0] * s[1], default=(0, 0))),  # type: ignore[index]
                                "largest": list(max(stored, key=lambda s: s[0] * s[1], default=(0, 0)))},  # type: ignore[index]
                "longest_conversation": {"tokens": longest[0], "image_tokens": sum(longest[1]) // merge}}


# --- rocktune plan --task vlm ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanRequest:
    """``rocktune plan MODEL --task vlm``'s question: the data (or an assumed image), the pixel limits, the budget."""

    model: str
    data: str | None = None
    max_pixels: int | None = None  # data.max_pixels (None: the processor's own)
    min_pixels: int | None = None
    image_size: tuple[int, int] | None = None  # without data: each image's stored size (None: a square at max_pixels)
    images: int = 1  # without data: images per conversation
    text_tokens: int = 512  # without data: tokens per conversation besides its images
    max_length: int = 4096  # data.max_length: a longer conversation is cut at its end
    vram: str | None = None
    device: str | None = None
    as_json: bool = False


def conversations(req: PlanRequest, vision: VisionTokens) -> list[Conversation]:
    """The data's conversations, every row and image read and checked as training reads them; or the assumed one."""
    from rocktune.models.load import load_tokenizer
    from rocktune.tasks.vlm.vision.model import with_processor_template

    tokenizer = with_processor_template(load_tokenizer(req.model, False), req.model)
    if req.data is None:
        image = req.image_size or default_image(vision)
        text = req.text_tokens + req.images * wrap_tokens(tokenizer, vision, image) if req.text_tokens > 0 else 0
        return assumed(text, image, req.images)
    import tempfile
    from pathlib import Path

    from rocktune.config import DataConfig
    from rocktune.tasks.vlm.data.vision import encode
    from rocktune.tasks.vlm.data.vision_source import read_rows

    d = DataConfig(train_file=req.data, max_length=req.max_length)
    with tempfile.TemporaryDirectory(prefix="rocktune-plan-") as tmp:
        rows, base = read_rows(req.data, d, Path(tmp) / "cache", "--data")
        examples = [encode(rec, base, tokenizer, vision, req.max_length, str(loc)) for loc, rec in rows]
    return from_examples(examples, vision)


def wrap_tokens(tokenizer, vision: VisionTokens, image: tuple[int, int]) -> int:
    """The tokens an image's placeholder text adds besides its image tokens, as the data code widens it: Gemma 3's
    begin/end of image and blank lines, Idefics3's/SmolVLM's tile tags and global view tags (Qwen's: none)."""
    rule = vision.rule
    if isinstance(rule, PatchGrid):
        return 0
    width, height = image
    grid = () if not isinstance(rule, SplitTiles) else tuple(
        int(x) for x in vision.image_processor.get_number_of_image_patches(height, width, {})[1:])
    return len(tokenizer(rule.text(grid), add_special_tokens=False)["input_ids"]) - rule.tokens(grid)


def default_image(vision: VisionTokens) -> tuple[int, int]:
    """The image assumed when neither data nor --image-size is given: the largest the processor keeps as it is."""
    size = vision.image_processor.size
    if isinstance(vision.rule, PatchGrid):  # Qwen's longest_edge is max_pixels: a square of that many pixels
        side = int(size["longest_edge"] ** 0.5)
    else:  # Gemma 3's one size (height x width); Idefics3's/SmolVLM's longest_edge, pixels a side
        side = size.get("longest_edge") or size["height"]
    return side, side


def resolution(vision: VisionTokens):
    """The pixel limits a plan may choose from (``tasks/vlm/fit.py``: ``Resolution``), None where the resolution is the
    processor's own: Gemma 3 (one size) and Idefics3/SmolVLM (longest_edge, which no data setting exposes)."""
    from rocktune.tasks.vlm.fit import Resolution

    if not isinstance(vision.rule, PatchGrid):
        return None
    return Resolution(vision.image_processor.size["longest_edge"], vision.image_processor.size["shortest_edge"])


def run_vlm_plan(req: PlanRequest, spec, global_batch: int) -> int:
    """``spec``: a ``planner.vlm.VLMSpec`` with the micro-batch, rank, precision and checkpointing asked for."""
    import json
    from dataclasses import asdict, replace

    from transformers import AutoConfig

    from rocktune.planner.budget import detect_budget, parse_budget
    from rocktune.planner.fit import MARGIN
    from rocktune.models.load import load_tokenizer
    from rocktune.tasks.vlm.planner.vlm import estimate_vlm, load_vlm_shape
    from rocktune.tasks.vlm.fit import fit_vlm, sized
    from rocktune.tasks.vlm.vision.model import model_type, vision_tokens

    model_type(req.model)
    text, vshape = load_vlm_shape(req.model)
    vision = vision_tokens(req.model, AutoConfig.from_pretrained(req.model), load_tokenizer(req.model, False),
                           req.min_pixels, req.max_pixels)
    limits = resolution(vision)
    asked_pixels = limits.max_pixels if limits else 0  # 0: the processor's own resolution
    sizes = DataSizes(conversations(req, vision), vision, (req.max_length, limits.min_pixels if limits else 0),
                      vshape)
    sizes.check_length(asked_pixels)
    budget, kind, source = (parse_budget(req.vram), "gpu", "given") if req.vram else detect_budget()
    base = replace(spec, device=req.device or kind)
    asked = sized(base, sizes, asked_pixels, spec.micro_batch, spec.checkpointing)
    est = estimate_vlm(text, vshape, asked)
    other = estimate_vlm(text, vshape, replace(asked, checkpointing=not asked.checkpointing))
    try:
        fit = asdict(fit_vlm(text, vshape, base, sizes, limits, (budget, source), global_batch))
    except UserError as exc:
        fit = {"error": str(exc)}
    usable = int(budget * (1 - MARGIN))
    doc = {"task": "vlm", "model": text.name, "n_params": vshape.model_params, "active_params": vshape.model_params,
           "images": sizes.describe(asked_pixels), "settings": asdict(asked), "terms": est.by_name(),
           "total_bytes": est.total_bytes, "peak_allocated_bytes": est.peak_allocated,
           "saved_activation_bytes": est.saved_bytes, "budget_bytes": budget, "budget_source": source,
           "fits": est.total_bytes <= usable, "terms_detail": [asdict(t) for t in est.terms],
           "other_checkpointing": {"checkpointing": other.spec.checkpointing, "terms": other.by_name(),
                                   "total_bytes": other.total_bytes, "fits": other.total_bytes <= usable},
           "fit": fit}
    if req.as_json:
        print(json.dumps(doc, indent=1))
    else:
        _render(est, other, doc)
    return 0


def _render(est, other, doc: dict) -> None:
    from rocktune.planner.report import param_count, render_table

    s, im = est.vspec, doc["images"]
    title = (f"{doc['model']}: {param_count(doc['n_params'])} params (language model, vision tower and projector), "
             f"LoRA r={s.lora_r} on the language model, {s.precision}, micro-batch {s.micro_batch} x {s.seq_len} "
             f"tokens with {len(s.patches)} images ({sum(s.patches):,} patches, {est.vision.merge**2} merged per "
             f"token), {s.attn}")
    console = render_table(est, other, doc, title)
    tokens, longest = im["tokens_per_image"], im["longest_conversation"]
    console.print(f"images: {im['conversations']} conversation(s), {im['images']} image(s) from "
                  f"{_size(im['image_sizes']['smallest'])} to {_size(im['image_sizes']['largest'])} pixels; "
                  f"{_at(im)} the processor makes {tokens['min']}-{tokens['max']} tokens an "
                  f"image; the longest conversation is {longest['tokens']} tokens, {longest['image_tokens']} of them "
                  "image tokens", highlight=False)
    fit = doc["fit"]
    if "error" in fit:
        console.print(f"[bold red]no fit:[/] {fit['error']}")
        return
    pixels = f"data.max_pixels={fit['max_pixels']} " if fit["max_pixels"] else ""
    console.print(f"[bold]suggested[/] for global batch {fit['micro_batch_size'] * fit['grad_accum']}: "
                  f"{pixels}micro_batch_size={fit['micro_batch_size']} "
                  f"grad_accum={fit['grad_accum']} gradient_checkpointing={fit['gradient_checkpointing']}")
    for reason in fit["reasons"]:
        console.print(f"  - {reason}", highlight=False)


def _at(im: dict) -> str:
    if im["max_pixels"] is None:
        return f"at the processor's own resolution (one token per {im['pixels_per_token']:,} pixels of a view)"
    return (f"at max_pixels={im['max_pixels']:,} (min_pixels={im['min_pixels']:,}, one token per "
            f"{im['pixels_per_token']:,} pixels)")


def _size(wh: list[int]) -> str:
    return f"{wh[0]}x{wh[1]}"
