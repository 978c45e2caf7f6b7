"""How one vision-language family turns an image into tokens and a batch's images into model inputs: the facts its
transformers processor class holds (which text an image placeholder becomes, how many tokens that is, how the pixels
are laid out), one small typed rule per kind of family.

- ``PatchGrid`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): one image pad per merged patch of the image processor's own grid
  (``image_grid_thw``), the pixels of all images concatenated as one flat row of patches each.
- ``FixedTokens`` (Gemma 3): every image is resized to the vision tower's fixed size and becomes the same number of
  soft tokens between its begin/end-of-image tokens; one ``(3, H, W)`` image per pixel row.
- ``SplitTiles`` (Idefics3, SmolVLM): an image is split into rows x cols tiles plus a global view, each tile a fixed
  run of image tokens after a row/col tag; the pixels are batched per conversation, ``(rows, images, 3, H, W)``.

The data layer widens placeholders and collates with a rule (tasks/vlm/data/vision.py, vision_batch.py); which rule a
model takes is decided by its family (tasks/vlm/vision/families.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from rocktune.errors import UserError


@dataclass(frozen=True)
class PatchGrid:
    image_token: str  # <|image_pad|>
    merge_size: int  # patches merged into one token per side
    type_ids: str | None = "mm_token_type_ids"  # marks the image tokens (Qwen3-VL places its 3-D positions by it)
    per_row: bool = False  # pixel_values concatenated across the batch

    def process_kwargs(self) -> dict:
        return {}

    def grid(self, out, k: int) -> tuple[int, ...]:
        return tuple(int(x) for x in out["image_grid_thw"][k])

    def tokens(self, grid: tuple[int, ...]) -> int:
        t, h, w = grid
        return t * h * w // self.merge_size**2

    def text(self, grid: tuple[int, ...]) -> str:
        return self.image_token * self.tokens(grid)

    def pixel_rows(self, grid: tuple[int, ...]) -> int:
        t, h, w = grid
        return t * h * w

    def pixels(self, processor, rows: list[list]) -> tuple[dict, list[tuple[int, ...]]]:
        """(the model's pixel inputs, each image's grid) for the images of a batch, by conversation."""
        out = processor(images=[im for row in rows for im in row], return_tensors="pt")
        grids = [self.grid(out, k) for k in range(len(out["image_grid_thw"]))]
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}, grids


@dataclass(frozen=True)
class FixedTokens:
    image_token: str  # <image_soft_token>
    begin: str  # <start_of_image>
    end: str  # <end_of_image>
    count: int  # soft tokens per image: the config's mm_tokens_per_image (256 in Gemma 3's checkpoints)
    type_ids: str | None = "token_type_ids"  # Gemma 3 attends bidirectionally within each image's tokens by it
    per_row: bool = False

    def process_kwargs(self) -> dict:
        return {}

    def grid(self, out, k: int) -> tuple[int, ...]:
        crops = out.get("num_crops")
        if crops is not None and int(crops[k]):  # the config refuses pan-and-scan; this guards a changed processor
            raise UserError("Gemma 3's pan-and-scan crops are not supported; set do_pan_and_scan: false in the "
                            "model's preprocessor_config.json.")
        return ()

    def tokens(self, grid: tuple[int, ...]) -> int:
        return self.count

    def text(self, grid: tuple[int, ...]) -> str:
        # Gemma3Processor's full image sequence: blank lines around begin, the soft tokens, end
        return f"\n\n{self.begin}{self.image_token * self.count}{self.end}\n\n"

    def pixel_rows(self, grid: tuple[int, ...]) -> int:
        return 1

    def pixels(self, processor, rows: list[list]) -> tuple[dict, list[tuple[int, ...]]]:
        out = processor(images=[im for row in rows for im in row], return_tensors="pt")
        grids = [self.grid(out, k) for k in range(len(out["pixel_values"]))]
        return {"pixel_values": out["pixel_values"]}, grids


@dataclass(frozen=True)
class SplitTiles:
    image_token: str  # <image>
    around: str  # <fake_token_around_image>
    global_tag: str  # <global-img>
    count: int  # image tokens per tile: (image_size / patch_size)^2 / scale_factor^2
    type_ids: str | None = None
    per_row: bool = True  # pixel_values (conversations, images, 3, H, W), zero images as padding

    def process_kwargs(self) -> dict:
        return {"return_row_col_info": True}

    def grid(self, out, k: int) -> tuple[int, ...]:
        return int(out["rows"][0][k]), int(out["cols"][0][k])

    def tokens(self, grid: tuple[int, ...]) -> int:
        rows, cols = grid
        return (rows * cols + 1) * self.count

    def text(self, grid: tuple[int, ...]) -> str:
        """Each tile tagged with its row and column (a line per row of tiles), then the global view; an image that
        is not split is its global view alone (the layout of transformers' Idefics3/SmolVLM processors)."""
        rows, cols = grid
        run = self.image_token * self.count
        whole = f"{self.around}{self.global_tag}{run}{self.around}"
        if rows == 0 and cols == 0:
            return whole
        lines = ["".join(f"{self.around}<row_{r + 1}_col_{c + 1}>{run}" for c in range(cols)) + "\n"
                 for r in range(rows)]
        return "".join(lines) + "\n" + whole

    def pixel_rows(self, grid: tuple[int, ...]) -> int:
        rows, cols = grid
        return rows * cols + 1  # tiles and the global view

    def pixels(self, processor, rows: list[list]) -> tuple[dict, list[tuple[int, ...]]]:
        out = processor(images=rows, return_tensors="pt", return_row_col_info=True)
        grids: list[tuple[int, ...]] = [(int(r), int(c)) for rr, cc in zip(out["rows"], out["cols"])
                                        for r, c in zip(rr, cc)]
        return {"pixel_values": out["pixel_values"], "pixel_attention_mask": out["pixel_attention_mask"]}, grids


ImageRule = PatchGrid | FixedTokens | SplitTiles
