"""The demo's `next:` suggests only what fits its model (issue 55, point 6): the tiny model is no chat model, so
generate is suggested with one of the demo's own prompts beside the base model, never --chat."""

from __future__ import annotations

import pytest

from rocktune.demo.task import make_task


class Stop(Exception):
    pass


def test_lm_demo_suggests_its_own_prompt_not_chat(tmp_path, monkeypatch):
    import rocktune.tasks
    from rocktune.demo import run as demo_run
    from rocktune.train import summary

    seen = {}

    def fake_train(cfg, options, quiet=False):
        seen["options"] = options
        raise Stop

    monkeypatch.setattr(rocktune.tasks, "train", fake_train)
    with pytest.raises(Stop):
        demo_run.run_demo(str(tmp_path / "demo"), as_json=True, steps=1)
    prompt = make_task(n_train=4000, n_eval=100, seed=0, skills=demo_run.DEMO_SKILLS)[1][0]["prompt"]
    assert seen["options"].next_prompt == prompt and prompt.endswith(" =")
    monkeypatch.setattr(summary, "_installed", lambda m: True)
    lines = "\n".join(summary.next_commands(tmp_path / "demo" / "run", prompt=seen["options"].next_prompt))
    assert f"generate {tmp_path / 'demo' / 'run'} --prompt '{prompt}' --compare" in lines
    assert "--chat" not in lines
