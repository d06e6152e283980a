"""`TrainConfig.amp_options` (`fp8lm.initialize` options passed from code) as a checkpoint records
them, so that what reads the checkpoint back (`fp8lm export`, `fp8lm generate`, ``--resume``)
builds the model the run trained, not the one its command-line options alone describe.

The record is plain data (no code runs when it is read): a `Recipe` and a `Policy` as their
``to_dict``, JSON values as they are. What cannot be written so (a ``module_filter`` function)
is named under ``"unrecorded"``; a reader that needs it refuses the checkpoint.
"""

from __future__ import annotations

import json
from typing import Any

from ..policy import Policy, resolve_policy
from ..recipe import Recipe, recipe_from
from .checkpoint import CheckpointError

__all__ = ["MODEL_OPTIONS", "record_amp_options", "recorded_model_options", "amp_options_change"]

# The fp8lm.initialize options that decide the model (the others, optimizer_options, its optimizer).
MODEL_OPTIONS = ("recipe", "policy", "module_filter", "multiple_of", "activations")


def record_amp_options(options: dict, opt_level: str) -> dict:
    """The checkpoint's record of ``options`` at ``opt_level``: ``{"options": {...}, "unrecorded": [...]}``
    (the policy resolved as `fp8lm.initialize` resolves it)."""
    recorded: dict[str, Any] = {}
    unrecorded = []
    for key, value in options.items():
        if key == "recipe":
            recorded[key] = recipe_from(value, "amp_options").to_dict()
        elif key == "policy":
            recorded[key] = resolve_policy(value, opt_level).to_dict()
        elif _is_json(value):
            recorded[key] = value
        else:
            unrecorded.append(key)
    return {"options": recorded, "unrecorded": sorted(unrecorded)}


def _is_json(value) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def recorded_model_options(state: dict) -> dict:
    """The `fp8lm.initialize` options of `MODEL_OPTIONS` that checkpoint ``state``'s run passed
    from code (none for a checkpoint without a record); refuses one whose run passed such an
    option that it could not record."""
    where = f"checkpoint {state.get('path', '?')!r}"
    record = _checked_record(state.get("amp_options"), where)
    missing = [key for key in record["unrecorded"] if key in MODEL_OPTIONS]
    if missing:
        raise CheckpointError(
            f"{where} was trained with the fp8lm.initialize option {', '.join(missing)} passed from code, which a "
            "checkpoint cannot record: build the model in code and export it with fp8lm.export.save_pretrained"
        )
    options = {key: record["options"][key] for key in MODEL_OPTIONS if key in record["options"]}
    try:
        if "recipe" in options:
            options["recipe"] = Recipe.from_dict(options["recipe"])
        if "policy" in options:
            options["policy"] = Policy.from_dict(options["policy"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where} records invalid fp8lm.initialize options: {e}") from None
    return options


def _checked_record(record, where: str) -> dict:
    """``record`` as `record_amp_options` writes it (None: an empty one, a checkpoint from before)."""
    if record is None:
        return {"options": {}, "unrecorded": []}
    if (
        not isinstance(record, dict)
        or not isinstance(record.get("options"), dict)
        or not isinstance(record.get("unrecorded"), list)
        or not all(isinstance(key, str) for key in [*record["options"], *record["unrecorded"]])
    ):
        raise CheckpointError(f"{where} records its fp8lm.initialize options in an unknown form; pass one fp8lm wrote")
    return record


def amp_options_change(saved: dict | None, here: dict) -> list[str]:
    """The options whose record ``here`` differs from checkpoint record ``saved`` (none when the
    checkpoint has no record: written before they were recorded)."""
    if saved is None:
        return []
    saved = _checked_record(saved, "the checkpoint")
    before, now = saved["options"], here["options"]
    changed = {key for key in before.keys() | now.keys() if before.get(key) != now.get(key)}
    changed |= set(saved["unrecorded"]) ^ set(here["unrecorded"])
    return sorted(changed)
