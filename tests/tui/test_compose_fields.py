"""The Compose form's rows take their labels, kinds, choices and help from the experiment fields' metadata
(engine.model.experiment.setting), and every field that declares a form label has a row."""

from __future__ import annotations

import dataclasses

from charllm.engine.model import experiment
from charllm.engine.model.experiment import SECTIONS, resolve_key
from charllm.tui.screens.compose import FIELDS, HELP, NONE, PRECISIONS, Field


def test_the_form_rows_are_what_the_fields_declare():
    rows = [f for f in FIELDS.values() if f.key != "precision"]
    for row in rows:
        section, name = resolve_key(row.key)
        kind = SECTIONS[section]
        assert row.label == experiment.label(kind, name)
        assert row.help == experiment.help_text(kind, name)
        options = experiment.choices(kind, name)
        assert row.choices == tuple(NONE if c is None else c for c in options or ())
        assert row.kind == ("choice" if options else {bool: "bool", int: "int", int | None: "int?"}[
            experiment.field_types(kind)[name]])
    labelled = {(section, f.name) for section, kind in SECTIONS.items() for f in dataclasses.fields(kind)
                if f.metadata.get("label")}
    assert {resolve_key(row.key) for row in rows} == labelled
    assert dataclasses.replace(FIELDS["f-precision"], help="") == Field("precision", "precision", "choice", PRECISIONS)
    assert FIELDS["f-tensor_model_parallel_size"].label == "TP  tensor"
    assert FIELDS["f-training-seq_length"].kind == "int?"
    assert FIELDS["f-recompute_granularity"].choices == (NONE, "full", "selective")


def test_every_control_has_a_label_and_a_one_line_help():
    """Each row, the precision row and the preset pickers included, has a label and a hint line that
    fits one line of an 80-column terminal (the hint line is one row high)."""
    for wid, row in FIELDS.items():
        assert row.label and row.help == HELP[wid], wid
    assert set(HELP) == {"preset", "model", "hardware", *FIELDS}
    for wid, text in HELP.items():
        assert text and "\n" not in text and len(text) <= 78, (wid, text)
