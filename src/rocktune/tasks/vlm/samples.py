"""Sample generations of a vision-language run: the first eval conversations, each answered greedily with its
images at every eval pass, through the LM task's sampler (samples.jsonl, the progress output, the report, resume).

A prompt is the example's tokens before its first trained token; its images go with it as the model inputs its
collated batch holds. Examples whose images come after that point (a second image in a later turn) are skipped:
their prompt would show the model placeholders without pixels."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from rocktune.data import checks
from rocktune.data.encode import IGNORE
from rocktune.tasks.vlm.data.vision import VisionExample, VisionTokens
from rocktune.tasks.vlm.data.vision_batch import collate
from rocktune.tasks.causal.samples import Sampler, SampleSettings, prompts_from_examples
from rocktune.tasks.vlm.vision.model import model_inputs


class PromptIds(list):
    """A prompt's token ids (what the sampler decodes and shows) carrying its collated model inputs (pixels,
    grids), which the vision completion feeds the model."""

    inputs: dict


class VisionSampler(Sampler):
    @classmethod
    def for_examples(cls, run_dir: Path, tokenizer, examples: list[VisionExample], vision: VisionTokens,
                     settings: SampleSettings, redo_from: int, write: bool = True) -> VisionSampler:
        prompts: list[tuple[list[int], list[int] | None]] = []
        for e in examples:
            if len(prompts) == settings.count:
                break
            found = prompts_from_examples([e.input_ids], [e.labels], 1)
            if not found or found[0][0].count(vision.image_token_id) != e.image_tokens:
                continue
            ids, expected = found[0]
            prompt = PromptIds(ids)
            prompt.inputs = collate([replace(e, input_ids=ids, labels=[IGNORE] * len(ids))], tokenizer.pad_token_id,
                                    vision)
            prompts.append((prompt, expected))
        stops = sorted({*checks.stop_token_ids(tokenizer, "messages"), tokenizer.eos_token_id} - {None})
        return cls(run_dir / "samples.jsonl", tokenizer, prompts, stops, settings, redo_from, write)

    def _complete(self, model, ids: PromptIds) -> str:  # type: ignore[override]  # for_examples makes every prompt a PromptIds
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        inputs = {k: v.to(self.device) for k, v in model_inputs(base, ids.inputs).items()}
        with self.autocast():
            out = model.generate(**inputs, do_sample=False, max_new_tokens=self.max_new_tokens,
                                 eos_token_id=self.stop_ids, pad_token_id=self.tokenizer.pad_token_id)
        return self._text(out[0, len(ids):].tolist())
