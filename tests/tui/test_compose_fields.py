"""The Compose form's rows take their labels, kinds and choices from the experiment fields' metadata
(engine.model.experiment.setting), and every field that declares a form label has a row."""

from __future__ import annotations

import dataclasses

from charllm.engine.model import experiment
from charllm.engine.model.experiment import SECTIONS, resolve_key
from charllm.tui.screens.compose import FIELDS, NONE, PRECISIONS, Field


def test_the_form_rows_are_what_the_fields_declare():
    rows = [f for f in FIELDS.values() if f.key != "precision"]
    for row in rows:
        section, name = resolve_key(row.key)
        kind = SECTIONS[section]
        assert row.label == experiment.label(kind, name)
        options = experiment.choices(kind, name)
        assert row.choices == tuple(NONE if c is None else c for c in options or ())
        assert row.kind == ("choice" if options else {bool: "bool", int: "int", int | None: "int?"}[
            experiment.field_types(kind)[name]])
    labelled = {(section, f.name) for section, kind in SECTIONS.items() for f in dataclasses.fields(kind)
                if f.metadata.get("label")}
    assert {resolve_key(row.key) for row in rows} == labelled
    assert FIELDS["f-precision"] == Field("precision", "precision", "choice", PRECISIONS)
    assert FIELDS["f-tensor_model_parallel_size"].label == "TP  tensor"
    assert FIELDS["f-training-seq_length"].kind == "int?"
    assert FIELDS["f-recompute_granularity"].choices == (NONE, "full", "selective")
