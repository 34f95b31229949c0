"""Compose: pick model, hardware and cluster; edit the layout; see validation, memory and speed at once.

Every edit re-validates (`engine.model.validate.validate`) and re-estimates the memory
(`engine.model.memory.estimate`) and the step time and power (`engine.model.speed.estimate`) in a
thread worker (debounced, the newest edit wins) that posts `ComposeScreen.Estimated`.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass

from rich.markup import escape
from textual import events, on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, VerticalScroll
from textual.lazy import Lazy
from textual.message import Message
from textual.widgets import Button, Checkbox, Input, Label, Select, Static
from textual.worker import get_current_worker

from charllm.engine.model import catalog, experiment, megatron, memory, speed, validate
from charllm.engine.model.experiment import SECTIONS, Experiment, Hardware, ModelSpec, field_types, resolve_key
from charllm.probes.core import paths
from charllm.probes.core.errors import UserError, plural
from charllm.probes.core.formatting import count, si
from charllm.tui.screens.base import WorkbenchScreen, edited_name
from charllm.tui.screens.dialogs import AskName, free_name
from charllm.tui.widgets.form import FormCheckbox, FormInput, FormSelect
from charllm.tui.widgets.memory_bars import MemoryBars

DEBOUNCE_S = 0.05
NONE = "none"   # Select value standing for "unset" (Megatron default)


@dataclass(frozen=True)
class Field:
    key: str                    # Experiment.set key
    label: str
    kind: str                   # int | int? (blank = unset) | bool | choice
    choices: tuple[str, ...] = ()
    help: str = ""              # the hint line shown while the field has focus

    @property
    def wid(self) -> str:
        return "f-" + self.key.replace(".", "-")

    @property
    def name(self) -> str:
        return self.key.rpartition(".")[2]

    @classmethod
    def of(cls, key: str) -> "Field":
        """The form field of an experiment field: its label, choices and help as the field declares them."""
        section, name = resolve_key(key)
        kind = SECTIONS[section]
        label, help = experiment.label(kind, name), experiment.help_text(kind, name)
        assert label is not None, f"{key}: a field on the form declares its label"
        options = experiment.choices(kind, name)
        if options:
            return cls(key, label, "choice", tuple(NONE if c is None else c for c in options), help)
        form = {bool: "bool", int: "int", int | None: "int?"}[field_types(kind)[name]]
        return cls(key, label, form, help=help)


PRECISIONS = ("bf16", "fp16", "fp8-e4m3", "fp8-hybrid", "fp32")
# The form's rows: experiment fields by key (Field.of), and precision, one choice over bf16, fp16 and fp8.
GROUPS: tuple[tuple[str, tuple[Field, ...]], ...] = tuple(
    (title, tuple(f if isinstance(f, Field) else Field.of(f) for f in group)) for title, group in (
        ("Cluster", ("cluster.nodes", "cluster.gpus_per_node")),
        ("Parallelism", ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                         "virtual_pipeline_model_parallel_size", "context_parallel_size",
                         "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel",
                         "use_distributed_optimizer")),
        ("Batch", ("micro_batch_size", "global_batch_size", "training.seq_length")),
        ("Recompute & overlap", ("recompute_granularity", "recompute_method", "recompute_num_layers",
                                 "overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap",
                                 Field("precision", "precision", "choice", PRECISIONS,
                                       "mixed precision: BF16, FP16, FP8 (e4m3 or hybrid, over BF16), or plain FP32"))),
    ))
FIELDS = {f.wid: f for _, group in GROUPS for f in group}
# The form fields that make up a size a problem may be about, which is no field of the form itself.
MADE_OF = {"world_size": ("nodes", "gpus_per_node", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                          "context_parallel_size"),
           "cluster": ("nodes", "gpus_per_node"),
           "num_layers": ("pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size")}
# The hint line of each control: the pickers' own, the fields' from their metadata.
HELP = {"preset": "load an experiment preset (shipped, or saved with ^s)",
        "model": "the model preset: architecture and sizes",
        "hardware": "the hardware preset: one device's memory, speed and power",
        **{wid: f.help for wid, f in FIELDS.items()}}


def get_value(exp: Experiment, field: Field):
    if field.key == "precision":
        t = exp.training
        return f"fp8-{t.fp8}" if t.fp8 else "fp16" if t.fp16 else "bf16" if t.bf16 else "fp32"
    section, name = resolve_key(field.key)
    return getattr(getattr(exp, section), name)


def set_value(exp: Experiment, field: Field, raw) -> None:
    """Apply one widget value through Experiment.set (which checks the type)."""
    if field.key == "precision":
        fp8 = raw.removeprefix("fp8-") if raw.startswith("fp8-") else None
        exp.set("bf16", raw == "bf16" or fp8 is not None)
        exp.set("fp16", raw == "fp16")
        exp.set("fp8", fp8)
        return
    if field.kind in ("int", "int?"):
        text = str(raw).strip()
        if not text and field.kind == "int?":
            value = None
        else:
            try:
                value = int(text)
            except ValueError:
                raise UserError(f"{field.name} = {text!r}: expected an integer") from None
    elif field.kind == "choice":
        value = None if raw == NONE else raw
    else:
        value = bool(raw)
    exp.set(field.key, value)


def with_preset(exp: Experiment, kind: str, name: str) -> Experiment:
    """A copy of `exp` with the model or hardware preset `name` in it, as Compose's pickers (and the
    command palette) put one in: a model makes a new experiment of it (`switch_model`); hardware is an edit."""
    exp = exp.copy()
    if kind == "model":
        switch_model(exp, ModelSpec.load(name))
    else:
        exp.hardware = Hardware.load(name)
        exp.name = edited_name(exp.name)
    return exp


def unset_text(exp: Experiment, field: Field) -> str:
    """What an optional field left blank means for `exp`: the value the experiment resolves it to where it
    does (the sequence length: the model's; expert TP: TP), else just unset (Megatron's default)."""
    resolved = isinstance(getattr(type(exp), field.name, None), property)
    return f"unset: {getattr(exp, field.name)}" if resolved else "unset"


def switch_model(exp: Experiment, model: ModelSpec) -> None:
    """Put `model` into `exp` as a new experiment of it: named after the model and hardware, with the
    training choices that belonged to the old model back at their defaults (the precision: tiny-local's
    FP32 is its CPU model's, not Llama-3 70B's; a sequence length set for it). The cluster, the layout
    and the batch stay: they are the user's, and validation says where they no longer fit."""
    default = experiment.Training()
    exp.model = model
    exp.name, exp.description = f"{model.name}-{exp.hardware.name}", ""
    for name in ("bf16", "fp16", "fp8", "seq_length"):
        setattr(exp.training, name, getattr(default, name))


def speed_text(fast: dict) -> str:
    """The layout's speed beside the memory bars: step, throughput and MFU; the step's shares;
    parameters and FLOPs; power; and where the rates come from (lines under 80 columns)."""
    if "unknown" in fast:
        return f"[yellow]{escape(fast['unknown'])}[/]"
    sh = fast["shares"]
    mfu = f"MFU {fast['mfu']:.1%}" if fast["mfu"] is not None else "MFU n/a"
    stages = fast["params_per_stage"]
    per_stage = count(stages[0]) if len(set(stages)) == 1 else "/".join(count(n) for n in stages)
    per_stage = f"{per_stage} per stage" if len(stages) > 1 else "one stage"
    power = (f"{fast['power_w']:.0f} W/device · {fast['energy_per_token_j']:.3g} J/token\n"
             if fast["power_w"] is not None else "")
    return (
        f"[b]step {fast['step_s']:.3g} s[/b] · {fast['tokens_per_s']:,.0f} tok/s · {mfu} ({fast['mfu_precision']})\n"
        f"compute {sh['compute']:.0%} · comm {sh['communication']:.0%} · bubble {sh['bubble']:.0%} · "
        f"host-bound {sh['host']:.0%} · other {sh['other']:.0%}\n"
        f"params {count(fast['params_total'])}, {per_stage} · {si(fast['flops_per_iteration'], 'FLOP')}/iter\n"
        f"{power}[dim]{escape(fast['basis'])}[/]"
    )


class Form(Grid):
    """The form's grid; once mounted (lazily) it shows the app's experiment."""

    def on_mount(self) -> None:
        screen = self.screen
        assert isinstance(screen, ComposeScreen)        # the form is only composed there
        screen.query_one("#preset").focus()     # the form is where keyboard work starts
        screen.sync_from_app(first_paint=True)


class ComposeScreen(WorkbenchScreen):
    MODE = "compose"
    BINDINGS = [
        Binding("ctrl+s", "save", "Save preset", id="compose.save", priority=True),
        Binding("ctrl+g", "export", "Megatron flags", id="compose.export", priority=True),
        Binding("ctrl+l", "launch", "Launch…", id="compose.launch", priority=True),
    ]

    @dataclass
    class Estimated(Message):
        """Validation and memory estimate for experiment edit number `serial`."""

        serial: int
        problems: list            # engine.model.validate.Problem
        report: dict | None       # MemoryReport.to_dict(), None when it could not be computed
        error: str | None         # why there is no report
        flags: list[str] | None = None   # engine.model.megatron.export_megatron_args(exp)
        speed: dict | None = None        # engine.model.speed.SpeedReport.to_dict(), with "basis"

    def __init__(self):
        super().__init__()
        self.edit_serial = 0
        self.seen_app_serial = -1
        self.last_edited: str | None = None
        self.placed: dict[str, str] = {}    # problem field -> the form field it was shown beside
        self.typing_errors: set[str] = set()
        self.last: ComposeScreen.Estimated | None = None

    # -- layout ------------------------------------------------------------------------------
    def compose_body(self) -> ComposeResult:
        with Horizontal(id="compose"):
            # The form (~130 widgets) mounts just after the first frame: the screen appears at once.
            with Lazy(VerticalScroll(id="form")), Form(id="form-grid"):
                yield from self._row("preset", "preset",
                                     FormSelect(self._options("experiments"), id="preset", compact=True,
                                            prompt="(load a preset)"))
                yield from self._row("model", "model",
                                     FormSelect(self._options("models"), id="model", compact=True, allow_blank=False))
                yield from self._row("hardware", "hardware",
                                     FormSelect(self._options("hardware"), id="hardware", compact=True,
                                            allow_blank=False))
                for title, group in GROUPS:
                    yield Label(title, classes="group-title")
                    for field in group:
                        yield from self._row(field.wid, field.label, self._control(field))
            with VerticalScroll(id="plan"):
                yield Static(id="summary")
                yield MemoryBars(id="bars")
                yield Static(id="speed")
                yield Static(id="verdict")
                yield Static(id="problems")
                with Horizontal(classes="buttons"):
                    yield Button("Save ^s", id="save", compact=True)
                    yield Button("Flags ^g", id="export", compact=True)
                    yield Button("Launch ^l", id="launch", variant="primary", compact=True)
                yield Static(id="flags")
        yield Static(id="field-help", classes="hint")

    @staticmethod
    def _options(kind: str) -> list[tuple[str, str]]:
        return [(name, name) for name in catalog.entries(kind)]

    @staticmethod
    def _row(wid: str, label: str, control) -> ComposeResult:
        """Label and control side by side in the form's grid; the error (hidden) spans the row below."""
        yield Label(label, classes="field-label")
        yield control
        yield Static(id=f"err-{wid}", classes="field-error")

    @staticmethod
    def _control(field: Field):
        if field.kind == "bool":
            return FormCheckbox(id=field.wid, compact=True)
        if field.kind == "choice":
            return FormSelect([(c, c) for c in field.choices], id=field.wid, compact=True, allow_blank=False)
        # Any text is taken (not only digits, which Textual's integer type would silently drop): what is not
        # a number is said beside the field.
        return FormInput(id=field.wid, compact=True)

    # -- state <-> widgets -----------------------------------------------------------------
    def on_screen_resume(self) -> None:
        if self.seen_app_serial != self.app.experiment_serial and self.query(Form):
            self.sync_from_app()

    def sync_from_app(self, first_paint: bool = False) -> None:
        """Show app.experiment in every control (without treating that as edits), then estimate."""
        if not self.query(Form):
            return  # not mounted yet: the form syncs itself when it mounts
        self.seen_app_serial = self.app.experiment_serial
        exp = self.app.experiment
        with self.prevent(Input.Changed, Select.Changed, Checkbox.Changed):
            self._set_select("model", exp.model.name)
            self._set_select("hardware", exp.hardware.name)
            for field in FIELDS.values():
                value = get_value(exp, field)
                if field.kind == "bool":
                    self.query_one(f"#{field.wid}", Checkbox).value = bool(value)
                elif field.kind == "choice":
                    self.query_one(f"#{field.wid}", Select).value = NONE if value is None else value
                else:
                    self.query_one(f"#{field.wid}", Input).value = "" if value is None else str(value)
        for err in self.query(".field-error").results(Static):
            err.update("")
            err.remove_class("shown")
        self.typing_errors.clear()
        self.last_edited = None
        if first_paint:
            self.call_after_refresh(self.refresh_plan)   # paint first; the estimate's imports come after
        else:
            self.refresh_plan()

    def _set_select(self, wid: str, name: str) -> None:
        select = self.query_one(f"#{wid}", Select)
        names = list(catalog.entries({"model": "models", "hardware": "hardware"}[wid]))
        if name not in names:  # a model/hardware defined inline in the experiment file
            names.insert(0, name)
        select.set_options([(n, n) for n in names])
        select.value = name

    @on(events.DescendantFocus)
    def show_help(self, event: events.DescendantFocus) -> None:
        """The focused control's hint line (a Select's open list counts as the Select); none for a button."""
        wid = next((node.id for node in event.widget.ancestors_with_self if node.id in HELP), None)
        self.query_one("#field-help", Static).update(HELP.get(wid, "") if wid else "")

    @on(Input.Changed)
    @on(Checkbox.Changed)
    @on(Select.Changed)
    def on_edit(self, event) -> None:
        wid = event.control.id
        if event.value != event.control.value:
            return  # stale: posted before the control was last set (e.g. a Select's first option on mount)
        if wid == "preset":
            if event.value is not Select.NULL:
                self._load_preset(event.value)
            return
        exp = self.app.experiment.copy()
        try:
            if wid in ("model", "hardware"):
                exp = with_preset(exp, wid, event.value)
            elif wid in FIELDS:
                set_value(exp, FIELDS[wid], event.value)
            else:
                return
        except UserError as exc:
            self._field_error(wid, str(exc))
            return
        self._field_error(wid, "")
        if exp == self.app.experiment:
            return                      # a control set to what the experiment already has
        self.last_edited = wid
        if wid != "model":                  # a new model names its experiment itself
            exp.name = edited_name(exp.name)
        self.app.experiment = exp
        if wid == "model":
            self.sync_from_app()            # the fields the model change reset
        else:
            self.refresh_plan()

    def _load_preset(self, name: str) -> None:
        try:
            exp = Experiment.load(name)
        except UserError as exc:
            self.notify(str(exc), severity="error")
            return
        self.app.use_experiment(exp)

    def _field_error(self, wid: str, message: str, *, keep_typing_error: bool = False) -> None:
        if keep_typing_error and wid in self.typing_errors:
            return  # the value typed there could not even be set; that message stays until fixed
        if not keep_typing_error:
            self.typing_errors.discard(wid)
            if message:
                self.typing_errors.add(wid)
        for err in self.query(f"#err-{wid}").results(Static):
            err.update(message)
            err.set_class(bool(message), "shown")

    def _field_for(self, problem) -> str | None:
        """The form field a problem belongs beside: its own field; else, of the fields it concerns (those
        its rule names, or that make up the size it is about: world_size is nodes x GPUs = TP x PP x CP x
        DP), the one just edited, else the one it was beside, else the first; None (the list under the
        verdict) for a problem of no form field (a model's num_attention_heads for another TP is beside
        TP: its rule names TP)."""
        name = problem.field.rpartition(".")[2]
        by_name = {f.name: wid for wid, f in FIELDS.items()}
        if name in by_name:
            return by_name[name]
        rule = str(problem)
        concerned = [wid for n, wid in by_name.items() if n in rule] + [by_name[n] for n in MADE_OF.get(name, ())]
        for wid in (self.last_edited, self.placed.get(problem.field)):
            if wid in concerned:
                return wid
        return concerned[0] if concerned else None

    # -- validation and estimate ---------------------------------------------------------
    def refresh_plan(self) -> None:
        self.edit_serial += 1
        exp = self.app.experiment
        for field in FIELDS.values():
            if field.kind == "int?":
                self.query_one(f"#{field.wid}", Input).placeholder = unset_text(exp, field)
        self.query_one("#summary", Static).update(
            f"[b]{exp.name}[/b]  {exp.model.name} on {exp.cluster.nodes}×{exp.cluster.gpus_per_node} "
            f"{exp.hardware.name}\nworld {exp.world_size} · DP {exp.data_parallel_size} · "
            f"{plural(exp.num_microbatches, 'micro-batch', 'micro-batches')} of {exp.training.micro_batch_size} × "
            f"{exp.seq_length} tokens")
        self.plan(exp.copy(), self.edit_serial)

    @work(thread=True, exclusive=True, group="plan")
    def plan(self, exp: Experiment, serial: int) -> None:
        time.sleep(DEBOUNCE_S)        # typing "128" re-estimates once, not three times
        if get_current_worker().is_cancelled:
            return
        problems, report, error, fast, flags = [], None, None, None, None
        # Whatever was typed, the workbench stays up: an engine bug is shown, and editing goes on.
        try:
            problems = validate.validate(exp)
            if not problems:
                report = memory.estimate(exp).to_dict()
                found = speed.estimate(exp)
                fast = {**found.to_dict(), "basis": speed.describe(exp)} if found else {"unknown": speed.unknown(exp)}
        except UserError as exc:
            error = str(exc)
        except Exception as exc:  # noqa: BLE001 - see above
            error = f"estimate failed: {exc!r}"
        try:
            flags = megatron.export_megatron_args(exp)
        except UserError:
            pass        # flags Megatron cannot take: the problems say why
        except Exception as exc:  # noqa: BLE001 - see above
            error = error or f"Megatron flags failed: {exc!r}"
        self.post_message(self.Estimated(serial, problems, report, error, flags, fast))

    def on_compose_screen_estimated(self, message: Estimated) -> None:
        if message.serial != self.edit_serial:
            return  # an older edit's answer
        self.last = message
        by_field: dict[str, list[str]] = {}
        other: list[str] = []
        placed: dict[str, str] = {}
        for problem in message.problems:
            wid = self._field_for(problem)
            (by_field.setdefault(wid, []) if wid else other).append(str(problem))
            if wid:
                placed[problem.field] = wid
        self.placed = placed
        for wid in FIELDS:
            self._field_error(wid, "\n".join(by_field.get(wid, [])), keep_typing_error=True)
            self.query_one(f"#{wid}").set_class(wid in by_field, "invalid")
        self.query_one("#problems", Static).update("\n".join(f"[red]✗[/] {p}" for p in other))
        self.query_one("#bars", MemoryBars).report = message.report
        shown = self.query_one("#speed", Static)
        shown.display = message.speed is not None
        shown.update(speed_text(message.speed) if message.speed else "")
        if message.flags:
            how = "^g exports them once the layout is valid" if message.problems else "^g copies and writes them"
            self.query_one("#flags", Static).update(
                f"[b]Megatron-LM arguments[/b] [dim]({how})[/]\n" + escape(shlex.join(message.flags)))
        verdict = self.query_one("#verdict", Static)
        if message.problems:
            more = len(message.problems) - 1
            verdict.update(f"[b red]INVALID[/] layout: {escape(str(message.problems[0]))}"
                           + (f" [dim](+{more} more; each is marked at its field)[/]" if more else ""))
        elif message.report is None:
            verdict.update(f"[yellow]{message.error}[/]")
        else:
            r = message.report
            word = f"[b {memory.VERDICT_STYLE[r['verdict']]}]{r['verdict'].upper()}[/]"
            *arithmetic, conclusion = r["arithmetic"]
            notes = "".join(f"\n[yellow]![/] {w}" for w in r.get("warnings", []))
            blocked = "".join(f"\n[red]✗ will not launch:[/] {escape(p)}" for p in r.get("cannot_run", []))
            impl = r["implementation"]
            exp = self.app.experiment
            if r["verdict"] == memory.DOES_NOT_FIT and exp.description and not exp.name.endswith("-edited"):
                notes += f"\n[dim]{escape(exp.description)}[/]"      # an unedited preset says why it is listed
            verdict.update(f"{word}  {escape(conclusion)}\n"
                           + "".join(f"[dim]{escape(line)}[/]\n" for line in arithmetic)
                           + f"[dim]runs as {impl['transformer_impl']} · attention {impl['attention']} "
                           f"({escape(r['stack'])})[/]{blocked}{notes}")

    # -- actions -------------------------------------------------------------------------
    def on_button_pressed(self, event: Button.Pressed) -> None:
        assert event.button.id is not None     # each button here has its action's id
        {"save": self.action_save, "export": self.action_export, "launch": self.action_launch}[event.button.id]()

    def action_save(self) -> None:
        def save(name: str | None) -> None:
            if not name:
                return
            exp = self.app.experiment.copy()
            exp.name = name
            try:
                path = catalog.new_user_preset("experiments", name)
                exp.save(path)
            except (UserError, OSError) as exc:
                self.notify(f"save {name!r}: {exc}", severity="error")
                return
            self.app.experiment = exp
            self.refresh_plan()
            self.query_one("#preset", Select).set_options(self._options("experiments"))
            self.notify(f"saved experiment preset {name!r} to {path}")

        def check(name: str) -> None:
            catalog.new_user_preset("experiments", name)       # a shipped name or a path is refused here

        def refused(name: str) -> bool:
            try:
                check(name)
            except UserError:
                return True
            return False

        self.app.push_screen(AskName("Save experiment preset as:", free_name(self.app.experiment.name, refused),
                                     check), save)

    def action_export(self) -> None:
        problems = validate.validate(self.app.experiment)
        if problems:        # flags Megatron would refuse, or train what was not meant
            more = f" (+{len(problems) - 1} more, each beside its field)" if len(problems) > 1 else ""
            self.notify(f"no flags exported: the layout is invalid: {problems[0]}{more}", severity="error")
            return
        try:
            args = megatron.export_megatron_args(self.app.experiment)
        except UserError as exc:
            self.notify(str(exc), severity="error")
            return
        text = shlex.join(args)
        path = paths.data_dir() / "exports" / f"{self.app.experiment.name}.megatron-args"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(" \\\n  ".join(shlex.quote(a) if not a.startswith("--") else a for a in args) + "\n")
        self.app.copy_to_clipboard(text)
        self.notify(f"{len(args)} Megatron arguments copied to the clipboard and written to {path}")

    def action_launch(self) -> None:
        self.app.switch_mode("launch")
