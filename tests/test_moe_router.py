"""Router and balance on tiny Qwen3-MoE and Mixtral models: routers frozen unless lora.train_router, the expert load
counted from the routers' own top-k, the auxiliary loss equal to transformers' load_balancing_loss_func, an idle
expert said once, and the checkpointed recomputation not counted twice."""

from __future__ import annotations

import importlib

import pytest
import torch

from rocktune.errors import UserError
from rocktune.models.load import apply_lora
from rocktune.models.routers import router_modules
from rocktune.tasks.causal.moe_metrics import RouterWatch
from tests.family_fixtures import BY_NAME, TEMPLATES, build_tokenizer, family_config

MOE_FAMILIES = ("qwen3-moe", "mixtral")


def tiny(name: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    fam = BY_NAME[name]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(fam, build_tokenizer(TEMPLATES[fam.template])),
                                             dtype=torch.float32)
    model.config.use_cache = False
    return model


def batch(b: int = 2, s: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 300, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_routers_frozen_by_default_trained_on_request(name):
    frozen = apply_lora(tiny(name), 4, 8, 0.0, "all-linear", False)
    routers = router_modules(frozen)
    assert len(routers) == 2  # one per layer
    assert not any(p.requires_grad for _, m in routers for p in m.parameters())
    assert [n for n, p in frozen.named_parameters() if p.requires_grad and "lora_" not in n] == []
    trained = apply_lora(tiny(name), 4, 8, 0.0, "all-linear", False, train_router=True)
    routers = router_modules(trained)
    assert len(routers) == 2 and all(".modules_to_save." in n for n, _ in routers)
    assert all(p.requires_grad for _, m in routers for p in m.parameters())
    before = [m.weight.detach().clone() for _, m in routers]
    opt = torch.optim.SGD([p for p in trained.parameters() if p.requires_grad], lr=1.0)
    ids = batch()
    trained(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert all(not torch.equal(b, m.weight) for b, (_, m) in zip(before, routers))


def test_train_router_on_a_dense_model_is_refused():
    with pytest.raises(UserError, match="lora.train_router"):
        apply_lora(tiny("qwen2.5"), 4, 8, 0.0, "all-linear", False, train_router=True)


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_expert_load_and_aux_loss_match_transformers(name):
    model = apply_lora(tiny(name), 4, 8, 0.0, "all-linear", False)
    watch = RouterWatch.attach(model)
    ids = batch()
    base = model.get_base_model()
    out = base(input_ids=ids, output_router_logits=True)  # the family's own router logits, one per layer
    logits = out.router_logits
    cfg = base.config
    k = cfg.num_experts_per_tok
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    want_load = sum(torch.bincount(g.topk(k, -1).indices.reshape(-1), minlength=experts) for g in logits)
    lb = importlib.import_module(type(base).__module__).load_balancing_loss_func
    want_aux = float(lb(logits, experts, k))
    got = watch.step_metrics()
    assert got["expert_load"] == want_load.tolist()
    assert sum(got["expert_load"]) == 2 * ids.numel() * k  # 2 layers x tokens x top-k
    assert got["experts_idle"] == sum(int((torch.bincount(g.topk(k, -1).indices.reshape(-1), minlength=experts)
                                           == 0).sum()) for g in logits)
    assert got["router_aux_loss"] == pytest.approx(want_aux, rel=1e-5)
    assert watch.step_metrics() == {}  # reset: the next step starts from nothing


def test_eval_and_checkpoint_recompute_are_not_counted():
    model = apply_lora(tiny("qwen3-moe"), 4, 8, 0.0, "all-linear", True)
    watch = RouterWatch.attach(model)
    ids = batch()
    with torch.no_grad():
        model(input_ids=ids)
    assert watch.step_metrics() == {}
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()  # each layer runs again in backward (checkpointing)
    assert sum(watch.step_metrics()["expert_load"]) == 2 * ids.numel() * 2


def test_idle_expert_said_once():
    said = []
    model = tiny("mixtral")
    watch = RouterWatch.attach(model, log=said.append, patience=3)
    for module in [m for _, m in router_modules(model)]:
        with torch.no_grad():  # expert 3 of every layer never wins: its logit is far below the others
            module.weight[3] = -module.weight[:3].abs().sum(0) * 100
    x = torch.randn(1, 16, 64).abs()
    for _ in range(5):
        for module in [m for _, m in router_modules(model)]:
            module(x.reshape(-1, 64))
        metrics = watch.step_metrics()
        assert metrics["expert_load"][3] == 0
    assert len(said) == 1 and "received no token for 3 steps" in said[0]
    assert "expert 3" in said[0]


def test_train_logs_expert_load_and_aux_loss(tmp_path):
    """`rocktune train` on a tiny Qwen3-MoE: every step's metrics line holds the expert load (the routers saw
    every token of the step's forwards, padding included, top-k times in each of 2 layers) and the aux loss."""
    import json

    from rocktune.config import config_from_dict
    from rocktune.tasks import train
    from tests.conftest import tiny_run_config, write_jsonl
    from tests.family_fixtures import build_family, chat_records

    model_dir = build_family(BY_NAME["qwen3-moe"], tmp_path / "model")
    data = write_jsonl(tmp_path / "train.jsonl", chat_records(32, True))
    cfg = tiny_run_config(model_dir, data, None, tmp_path / "out", max_steps=3, micro_batch_size=4, grad_accum=1,
                          lr=1e-2, warmup_steps=0)
    cfg["data"].update(max_length=64, eval_fraction=0.0)
    cfg["lora"]["r"] = 4
    cfg["reliability"] = {"save_every": 2, "min_free_disk_mb": 0}
    train(config_from_dict(cfg), quiet=True)
    # the checkpoint keeps the idle streaks (layers x experts) for a resume; resuming it to 4 steps runs on from them
    meta = json.loads(next((tmp_path / "out" / "checkpoints").glob("step-*/meta.json")).read_text())
    assert [len(row) for row in meta["extra"]["router_watch"]["idle_steps"]] == [4, 4]
    cfg["training"]["max_steps"] = 4
    from rocktune.train.request import RunOptions

    train(config_from_dict(cfg), RunOptions(resume=True, resume_force=True), quiet=True)
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert len(r["expert_load"]) == 4
        assert sum(r["expert_load"]) == r["batch_tokens"] * 2 * 2
        assert 0 <= r["experts_idle"] <= 8
        assert 1.0 < r["router_aux_loss"] < 4.0  # E x sum(share x prob): top-k (2) when even, at most E
    # rocktune report draws the expert load (a heat map) and the aux loss
    from rocktune.report.run_report import run_report

    assert run_report([str(tmp_path / "out")]) == 0
    plots = tmp_path / "out" / "report_plots"
    assert (plots / "expert_load.png").read_bytes()[:4] == b"\x89PNG"
    assert (plots / "router_aux_loss.png").read_bytes()[:4] == b"\x89PNG"
    assert "Expert load (mixture of experts)" in (tmp_path / "out" / "report.html").read_text()


def test_expert_load_shares_leave_out_bad_lines():
    from rocktune.report.plots import expert_loads
    from rocktune.report.rundata import RunData

    steps = [{"step": 1, "expert_load": [2, 6, 0, 0]}, {"step": 2, "expert_load": [1, 1]},
             {"step": 3, "expert_load": ["x", 1, 1, 1]}, {"step": 4, "expert_load": [0, 0, 0, 0]},
             {"step": 5, "expert_load": [1, 1, 1, 1]}, {"step": 6}]
    run = RunData(path=None, name="r", steps=steps, evals=[])
    assert expert_loads(run) == ([1, 5], [[0.25, 0.75, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])


@pytest.mark.parametrize("name", sorted(f.name for f in BY_NAME.values() if f.moe))
def test_every_moe_family_counts_each_routed_token(name):
    """Every MoE family of the fixtures (their routers' own classes and outputs, Llama 4's (scores, logits)
    included): top-k picks per token in each MoE layer, one count per expert."""
    model = tiny(name)
    watch = RouterWatch.attach(model)
    ids = batch(2, 16)
    model(input_ids=ids)
    got = watch.step_metrics()
    cfg = model.config
    experts = next(getattr(cfg, k) for k in ("num_local_experts", "num_experts", "n_routed_experts")
                   if getattr(cfg, k, None))
    assert len(got["expert_load"]) == experts == watch.experts
    assert sum(got["expert_load"]) == len(watch.names) * ids.numel() * cfg.num_experts_per_tok
    assert ("router_aux_loss" in got) == (name not in ("glm4.5", "llama4"))


def test_train_router_end_to_end(tmp_path):
    """lora.train_router: true in a real `rocktune train`: the routers move and are saved in the adapter file
    beside the LoRA pairs."""
    from safetensors import safe_open

    from rocktune.config import config_from_dict
    from rocktune.tasks import train
    from tests.conftest import tiny_run_config, write_jsonl
    from tests.family_fixtures import build_family, chat_records

    model_dir = build_family(BY_NAME["qwen3-moe"], tmp_path / "model")
    data = write_jsonl(tmp_path / "train.jsonl", chat_records(16, True))
    cfg = tiny_run_config(model_dir, data, None, tmp_path / "out", max_steps=2, micro_batch_size=4, grad_accum=1,
                          lr=1e-2, warmup_steps=0)
    cfg["data"].update(max_length=64, eval_fraction=0.0)
    cfg["lora"].update(r=4, train_router=True)
    train(config_from_dict(cfg), quiet=True)
    from safetensors.torch import load_file

    base = load_file(str(next(model_dir.glob("*.safetensors"))))
    with safe_open(str(tmp_path / "out" / "adapter" / "adapter_model.safetensors"), "pt") as f:
        gates = {k: f.get_tensor(k) for k in f.keys() if k.endswith("mlp.gate.weight")}
    assert sorted(gates) == [f"base_model.model.model.layers.{i}.mlp.gate.weight" for i in (0, 1)]
    for i in (0, 1):
        assert not torch.equal(gates[f"base_model.model.model.layers.{i}.mlp.gate.weight"],
                               base[f"model.layers.{i}.mlp.gate.weight"])


def test_idle_streaks_survive_a_checkpoint():
    """A resumed run keeps the idle streaks and says no expert twice (the state goes through the checkpoint's JSON)."""
    import json

    said = []
    model = tiny("mixtral")
    routers = [m for _, m in router_modules(model)]
    for module in routers:
        with torch.no_grad():
            module.weight[3] = -module.weight[:3].abs().sum(0) * 100
    x = torch.randn(16, 64).abs()

    def steps(watch, n):
        for _ in range(n):
            for module in routers:
                module(x)
            watch.step_metrics()

    first = RouterWatch.attach(model, log=said.append, patience=3)
    steps(first, 2)
    state = json.loads(json.dumps(first.state()))
    first.close()
    second = RouterWatch.attach(model, log=said.append, patience=3)
    second.load_state(state)
    steps(second, 1)  # the third step without a token: said now, as an uninterrupted run would
    assert len(said) == 1 and "expert 3" in said[0]
    third = RouterWatch.attach(model, log=said.append, patience=3)
    third.load_state(json.loads(json.dumps(second.state())))
    second.close()
    steps(third, 3)
    assert len(said) == 1  # never twice
