"""The vision-language families task=vlm trains: one typed entry each, keyed by transformers' ``model_type``, and the
one place their facts live. Standard library only, so that every layer can read it, the planner (torch-free, below
data/ and models/) included:

- the model: its display name, transformers' model class, the image processor classes it takes, where the vision
  tower and the projector sit in its module tree, whether its image processor takes ``min_pixels``/``max_pixels``,
  the lowest transformers major it is tested with, whether its conversations may be packed in a row;
- the placeholder rule (``Placeholder``): which of tasks/vlm/data/vision_rules.py's rules widens an image placeholder,
and the
  config keys of its token ids; tasks/vlm/vision/families.py builds the runtime rule and ``VisionTokens`` from it;
- the planner's facts (``PlanFacts``): which kind of tower tasks/vlm/planner/vlm.py sizes and how its image tokens are
made;
- the GGUF export's facts (``GgufFacts``): llama.cpp's projector type and how the state dict is split and named.

A new family is one entry here (plus its tiny-model builder in tasks/vlm/demo/tiny_vlm.py, keyed by the same name, and
its tests). A family not listed is refused with the list; nothing is trained half-understood.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Placeholder:
    """How the family's processor widens an image placeholder (tasks/vlm/data/vision_rules.py)."""
    kind: str  # "patch_grid" (Qwen: PatchGrid) | "fixed_tokens" (Gemma 3: FixedTokens) | "split_tiles" (SplitTiles)
    token_keys: tuple[str, ...] = ()  # the config's keys of the image token ids, the image token's first


@dataclass(frozen=True)
class PlanFacts:
    """What tasks/vlm/planner/vlm.py needs to size the vision side from config.json alone."""
    tower: str  # "qwen": the processor's own patch grid, rotary positions | "siglip": one fixed size per view
    embed_dim: bool = False  # Qwen2-VL: the tower's width is vision_config.embed_dim, hidden_size is its output's
    windows: bool = False  # Qwen2.5-VL: window-attention blocks (window_size pixels a side) between full ones
    gated: bool = False  # Qwen2.5-VL: SwiGLU MLP in the tower (the others: fc1 -> GELU -> fc2)
    pooled: bool = False  # SigLIP, Gemma 3: one image a view, pooled to mm_tokens_per_image (else tiles, shuffled
    #                       by scale_factor, gathered from a padded (conversations, images) batch with a pixel mask)
    bidirectional: bool = False  # Gemma 3's LM: image tokens attend both ways (never the plain causal mask), and its
    #                              sliding-window layers keep rotary tables and a mask of their own


@dataclass(frozen=True)
class GgufFacts:
    """How the GGUF export writes the family for llama.cpp (tasks/vlm/export/gguf_vision.py)."""
    projector: str  # gguf.VisionProjectorType attribute
    vision: tuple[str, ...] = ("model.visual.", "visual.")  # the vision side's names in transformers' state dict
    text: str = "model.language_model."  # the language model's (-> a causal LM's model.*)
    keep_model: bool = False  # gguf-py's table knows the vision names with their "model." (SmolVLM's checkpoints)
    silu: bool = False  # Qwen2.5-VL's gated SiLU MLP (Qwen2-VL's is quick-GELU, llama.cpp's default for the type)
    windows: bool = False  # Qwen2.5-VL's full-attention blocks as one period (clip.vision.n_wa_pattern)
    deepstack: bool = False  # Qwen3-VL's tower (Qwen3.5's too): GELU MLP, learned position embeddings, fused qkv, and
    #                          deepstack mergers feeding the LM where the config lists them (Qwen3.5 has none)
    siglip: bool = False  # a SigLIP tower (Gemma 3, Idefics3/SmolVLM): GELU, its own epsilon, embeddings kept f32
    pooling: bool = False  # Gemma 3: the projector pools kernel x kernel patches (else Idefics3's pixel shuffle)
    tower: tuple[str, str] | None = None  # (transformers' tower prefix, the published checkpoints' one)
    imrope: bool = False  # Qwen3.5: its language model's interleaved rotary sections, which only the image tokens'
    #                       3-D positions tell apart, must place every rotated pair as llama.cpp's imrope does


@dataclass(frozen=True)
class FamilyEntry:
    model_type: str  # transformers' config.json model_type, the key
    name: str  # as people call it
    model_class: str  # transformers' class
    image_processors: tuple[str, ...]  # the image processor classes it takes (their Pillow/fast variants too)
    roots: tuple[str, ...]  # the module names under which the vision side lives, the tower's first
    projector: str  # the part of a vision-side module's name that makes it the projector (Qwen's inside the tower)
    placeholder: Placeholder
    plan: PlanFacts
    gguf: GgufFacts
    pixel_limits: bool = False  # the image processor takes min_pixels / max_pixels
    transformers: int = 4  # the lowest transformers major it is tested with (the torch 2.4/2.5 stacks have 4.57)
    packing: bool = False  # data.packing: conversations packed in a row (Qwen: 3-D positions per conversation)
    processor_settings: dict[str, str] = field(default_factory=dict)  # the combined processor's settings the
    # model's config decides ({setting: "mm_tokens_per_image" (the config's key) | "tile_tokens" (computed)})
    text_task: bool = False  # the text tasks train the checkpoint too, as its causal LM (Qwen3.5, released as one
    # model with its eyes): never refused for them, and task=vlm only when the config asks for it


QWEN_PROCESSORS = ("Qwen2VLImageProcessor",)
TILE_PROCESSORS = ("SmolVLMImageProcessor", "Idefics3ImageProcessor")  # SmolVLM's first release is idefics3
QWEN_TOKENS = Placeholder("patch_grid", ("image_token_id", "vision_start_token_id", "vision_end_token_id"))
TILES = Placeholder("split_tiles", ("image_token_id",))
SIGLIP_TILES = PlanFacts("siglip")
# transformers 5 names Gemma 3's tower vision_tower.*; its checkpoints (and gguf-py's table) vision_tower.vision_model.*
GGUF_TILES = GgufFacts("IDEFICS3", ("model.vision_model.", "model.connector."), "model.text_model.", keep_model=True,
                       siglip=True)


def _qwen(model_type: str, name: str, model_class: str, plan: PlanFacts, gguf: GgufFacts) -> FamilyEntry:
    # Qwen's mergers (Qwen3-VL's deepstack mergers too) sit inside visual.*
    return FamilyEntry(model_type, name, model_class, QWEN_PROCESSORS, ("visual",), "merger", QWEN_TOKENS, plan, gguf,
                       pixel_limits=True, packing=True)


def _qwen35(model_type: str, name: str, model_class: str) -> FamilyEntry:
    return replace(_qwen(model_type, name, model_class, PlanFacts("qwen"),
                         GgufFacts("QWEN3VL", deepstack=True, imrope=True)), transformers=5, text_task=True)


def _tiles(model_type: str, name: str, model_class: str) -> FamilyEntry:
    return FamilyEntry(model_type, name, model_class, TILE_PROCESSORS, ("vision_model", "connector"), "connector",
                       TILES, SIGLIP_TILES, GGUF_TILES, transformers=5,
                       processor_settings={"image_seq_len": "tile_tokens"})


FAMILIES: dict[str, FamilyEntry] = {e.model_type: e for e in (
    _qwen("qwen2_5_vl", "Qwen2.5-VL", "Qwen2_5_VLForConditionalGeneration", PlanFacts("qwen", windows=True, gated=True),
          GgufFacts("QWEN25VL", silu=True, windows=True)),
    _qwen("qwen3_vl", "Qwen3-VL", "Qwen3VLForConditionalGeneration", PlanFacts("qwen"),
          GgufFacts("QWEN3VL", deepstack=True)),
    _qwen("qwen2_vl", "Qwen2-VL", "Qwen2VLForConditionalGeneration", PlanFacts("qwen", embed_dim=True),
          GgufFacts("QWEN2VL")),
    # Qwen3.5 and its MoE: Qwen3-VL's tower without deepstack mergers, before a hybrid Gated DeltaNet language model
    # (one model with its eyes); transformers 5 only
    _qwen35("qwen3_5", "Qwen3.5", "Qwen3_5ForConditionalGeneration"),
    _qwen35("qwen3_5_moe", "Qwen3.5-MoE", "Qwen3_5MoeForConditionalGeneration"),
    FamilyEntry("gemma3", "Gemma 3", "Gemma3ForConditionalGeneration", ("Gemma3ImageProcessor",),
                ("vision_tower", "multi_modal_projector"), "multi_modal_projector",
                Placeholder("fixed_tokens", ("image_token_id", "boi_token_id", "eoi_token_id")),
                PlanFacts("siglip", pooled=True, bidirectional=True),
                GgufFacts("GEMMA3", ("model.vision_tower.", "model.multi_modal_projector."), siglip=True, pooling=True,
                          tower=("vision_tower.", "vision_tower.vision_model.")),
                transformers=5, processor_settings={"image_seq_length": "mm_tokens_per_image"}),
    _tiles("smolvlm", "SmolVLM", "SmolVLMForConditionalGeneration"),
    _tiles("idefics3", "Idefics3", "Idefics3ForConditionalGeneration"),
)}


def names() -> str:
    """The families' display names, in the table's order (the adapter card, refusals)."""
    return ", ".join(e.name for e in FAMILIES.values())
