"""The ``preference:`` config section of task: dpo / orpo; config.py composes it into the run config from the
task's registry row."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rocktune.config_base import _Section, only


class PreferenceConfig(_Section):
    """task: dpo / orpo only (docs/preference.md); TRL's names and defaults."""

    beta: float = Field(0.1, gt=0, description="DPO: the strength of the pull towards the reference (the model with "
                        "its adapter off); higher keeps closer to it. ORPO: the weight of the odds-ratio term "
                        "(the paper's lambda) beside the chosen answer's likelihood.")
    loss_type: Literal["sigmoid", "ipo"] = Field(
        "sigmoid", json_schema_extra=only("dpo"), description="DPO loss. sigmoid: -log sigmoid(beta x the margin of "
        "log-ratios) (the DPO paper); ipo: (margin of per-token average log-ratios - 1/(2 beta))^2 (the IPO paper, "
        "length-normalised as TRL does).")
    label_smoothing: float = Field(
        0.0, ge=0.0, lt=0.5, json_schema_extra=only("dpo"), description="sigmoid loss: the share of pairs assumed "
        "mislabelled (conservative DPO): the loss mixes in -log sigmoid(-beta x margin) with this weight.")
    no_signal: Literal["auto", "drop", "refuse"] = Field(
        "auto", description="Pairs that teach nothing (chosen equal to rejected, or differing only in whitespace or "
        "past max_length; answers that share no prompt), each kind named with its count and rows. auto: dropped "
        "with a warning while they are at most half of the file, else the file is refused; drop: always dropped; "
        "refuse: any one stops the run.")
