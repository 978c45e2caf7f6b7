"""The task registry (task_registry.py) is the one table of tasks: the config's choices, which keys apply, the CLI's
choices and the task each run builds derive from it; keys that do not apply to a task are refused from the config's
field tags, never from a hand list."""

from __future__ import annotations

import pytest

from rocktune.config import RunConfig, config_from_dict, inapplicable
from rocktune.errors import UserError
from rocktune.task_registry import DIFFUSION, TASKS
from rocktune.train.request import RunOptions


def _cfg(task: str, **sections) -> RunConfig:
    model = {"name_or_path": "some/wan"} if task in DIFFUSION else {}
    return config_from_dict({"task": task, "model": model, "data": {"train_file": "t.jsonl"}, **sections})


def test_the_config_and_the_cli_take_the_registrys_tasks():
    import argparse

    from rocktune.cli import build_parser

    assert set(RunConfig.model_fields["task"].annotation.__args__) == set(TASKS)
    plan = next(a for a in build_parser()._subparsers._group_actions[0].choices["plan"]._actions
                if a.dest == "task")
    assert isinstance(plan, argparse.Action) and tuple(plan.choices) == tuple(TASKS)
    for name, spec in TASKS.items():
        assert _cfg(name).is_diffusion == (name in DIFFUSION) and _cfg(name).spec is spec


def test_every_field_tag_names_a_tag_some_task_has():
    known = set().union(*(s.tags for s in TASKS.values()))
    for section in RunConfig.model_fields.values():
        sections = [section.json_schema_extra] if section.json_schema_extra else []
        fields = getattr(section.annotation, "model_fields", {}).values()
        for tag in sections + [f.json_schema_extra for f in fields if f.json_schema_extra]:
            assert set(tag["tasks"]) <= known, tag


def test_keys_the_old_wan_hand_list_missed_are_refused():
    """tasks/wan/refuse.py's list promised LM-only keys would be refused and missed these."""
    cfg = _cfg("video-lora", training={"parallel": "fsdp", "loss_impl": "full"}, data={"train_file": "t",
                                                                                         "max_length": 512})
    assert inapplicable(cfg) == {"lm, dpo, orpo, grpo, vlm": ["data.max_length=512"],
                                 "lm, dpo, orpo, grpo": ["training.parallel=fsdp"], "lm": ["training.loss_impl=full"]}
    from rocktune.tasks import refuse_before_launch

    with pytest.raises(UserError,
                       match=r"data.max_length=512: only for task=lm, dpo, orpo, grpo, vlm; training.parallel=fsdp: "
                             r"only for task=lm, dpo, orpo, grpo;"):
        refuse_before_launch(cfg, RunOptions())
    # defaults and the harmless values of the old list are not refusals
    assert inapplicable(_cfg("video-lora", model={"name_or_path": "w", "liger": "off"},
                             training={"compile": False, "batching": "examples"})) == {}


def test_each_task_refuses_the_others_keys():
    assert inapplicable(_cfg("lm", diffusion={"frames": [5]}, preference={"beta": 0.3})) == {
        "video-lora, image-lora": ["diffusion.frames=[5]"], "dpo, orpo": ["preference.beta=0.3"]}
    assert inapplicable(_cfg("dpo", data={"train_file": "t", "packing": True})) == {"lm, vlm": ["data.packing=True"]}
    # the attention is the language model's for vlm too (auto, varlen, sdpa); sdpa stays harmless for Wan
    assert inapplicable(_cfg("vlm", model={"attn_implementation": "varlen"})) == {}
    assert inapplicable(_cfg("image-lora", model={"name_or_path": "w", "attn_implementation": "sdpa"})) == {}
    assert inapplicable(_cfg("image-lora", model={"name_or_path": "w", "attn_implementation": "varlen"})) == {
        "lm, dpo, orpo, grpo, vlm": ["model.attn_implementation=varlen"]}
    assert inapplicable(_cfg("orpo", preference={"label_smoothing": 0.1})) == {
        "dpo": ["preference.label_smoothing=0.1"]}
    assert inapplicable(_cfg("dpo", preference={"loss_type": "ipo", "beta": 0.5})) == {}


@pytest.mark.parametrize("task", ["lm", "dpo", "orpo", "grpo", "vlm"])
def test_make_task_builds_the_registered_class(task):
    from rocktune.tasks import make_task

    built = make_task(_cfg(task))
    assert f"{type(built).__module__}:{type(built).__name__}" == TASKS[task].builder
