"""The README and docs/*.md as a new user reads them: their snippets run, their option names,
defaults and environment variables are the code's, their commands parse.

Which snippets run, by the line right before a fence in the Markdown (an HTML comment, which
renders as nothing):

* every ```` ```python ```` fence runs, each in a fresh namespace (with ``torch`` and
  ``harmony_fx`` imported, as the README's first snippet does), in a fresh folder;
* ``<!-- not run: why -->`` leaves it out (it needs a GPU or several servers, or it shows a
  generated program, which a test here compares with ``hm.code`` instead);
* ``<!-- given: NAME -->`` runs ``GIVEN[NAME]`` first, in the same namespace: the names a fragment
  takes for granted (``model``, ``loss_fn``, ``x``, ``y``, ...), small enough to run in seconds.
  A ``GIVEN`` that needs an optional package is skipped without it, and a slow one (transformers'
  or Lightning's trainers) runs with ``-m slow``;
* where there is no GPU, a snippet's ``"cuda:0"`` runs as ``"host:0"`` (the HostDevice, the GPU
  stand-in the README names).

A new fence needs nothing to be checked; one that cannot run says why. Every ``harmony-fx``
command the docs show must parse; the planner's commands on presets run with ``-m slow``.
"""
from __future__ import annotations

import dataclasses
import inspect
import pathlib
import re
import textwrap

import pytest
import torch

import harmony_fx
from harmony_fx import config

ROOT = pathlib.Path(__file__).resolve().parents[1]
# docs/benchmarks.md is left out: its figures and the commands that measured them are a record of
# their day (elided with "...")
DOCS = [ROOT / "README.md", *(ROOT / "docs" / name for name in ("options.md", "how-it-works.md", "integrations.md"))]
_MARKER = re.compile(r"^<!--\s*(not run|given)\s*:\s*(.*?)\s*-->\s*$")


@dataclasses.dataclass(frozen=True)
class Snippet:
    path: pathlib.Path
    line: int            # the fence's line, 1-based
    code: str
    given: str | None    # a GIVEN name
    not_run: str | None  # why not

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _fences(path: pathlib.Path):
    """Each fence of ``path``: (its line, its info string, its text, the marker before it)."""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            start, info = i, lines[i][3:].strip()
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            before = lines[start - 1].strip() if start else ""
            yield start + 1, info, "\n".join(lines[start + 1:end]), _MARKER.match(before)
            i = end
        i += 1


def snippets() -> list[Snippet]:
    found = []
    for path in DOCS:
        for line, info, code, marker in _fences(path):
            if info != "python":
                continue
            kind, value = marker.groups() if marker else (None, None)
            found.append(Snippet(path, line, textwrap.dedent(code), value if kind == "given" else None,
                                 value if kind == "not run" else None))
    return found


# ---------------------------------------------------------------------------- what fragments take for granted
def _mlp(ns: dict) -> None:
    from torch import nn

    torch.manual_seed(0)
    ns["model"] = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    ns["loss_fn"] = nn.functional.cross_entropy
    ns["x"] = ns["inputs"] = torch.randn(8, 16)
    ns["y"] = ns["target"] = torch.randint(0, 4, (8,))
    ns["x_val"] = torch.randn(8, 16)
    ns["optimizer"] = torch.optim.SGD(ns["model"].parameters(), lr=0.1)
    ns["torch"], ns["nn"] = torch, nn


def _tiny_gpt2(dropout: float = 0.0):
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout))


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0))


def _tokens(rows: int = 4) -> torch.Tensor:
    return torch.randint(0, 64, (rows, 12), generator=torch.Generator().manual_seed(1))


def _trainer(ns: dict) -> None:
    """The README's ``harmony_fx.Trainer``: an MLP, and a model that computes its own loss."""
    _mlp(ns)
    ids = _tokens()
    ns["gpt2"], ns["batch"] = _tiny_gpt2(), {"input_ids": ids, "labels": ids}


def _causal_lm(ns: dict) -> None:
    ids = _tokens()
    ns["model"], ns["batch"], ns["torch"] = _tiny_gpt2(), {"input_ids": ids, "labels": ids}, torch


def _hf_trainer(ns: dict) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    rows = [{"input_ids": r, "labels": r} for r in _tokens(40)]
    ns.update(model=_tiny_llama(), train=rows[:32], val=rows[32:], collator=transformers.default_data_collator)


def _lightning(ns: dict) -> None:
    L = pytest.importorskip("lightning")
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

        def _loss(self, batch):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def training_step(self, batch, batch_idx):
            return self._loss(batch)

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self._loss(batch))

        def test_step(self, batch, batch_idx):
            self.log("test_loss", self._loss(batch))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(32, 16), torch.randint(0, 4, (32,))), batch_size=16)
    ns.update(L=L, module=Classifier(), train_loader=loader, val_loader=loader, test_loader=loader)
    ns["lightning_module"] = ns["module"]


def _accelerate(ns: dict) -> None:
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()
    torch.manual_seed(0)
    model = _tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ns.update(accelerator=accelerate.Accelerator(gradient_accumulation_steps=2), model=model, optimizer=optimizer,
              loader=torch.utils.data.DataLoader([{"input_ids": r, "labels": r} for r in _tokens(8)], batch_size=4),
              scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 2), harmony_fx=harmony_fx)


# name: (what it sets up, whether it is slow: transformers' and Lightning's trainers take seconds)
GIVEN = {
    "mlp": (_mlp, False),
    "trainer": (_trainer, False),
    "causal-lm": (_causal_lm, True),
    "hf-trainer": (_hf_trainer, True),
    "lightning": (_lightning, True),
    "accelerate": (_accelerate, True),
}


def _params():
    for snippet in snippets():
        if snippet.not_run is not None:
            continue
        slow = snippet.given in GIVEN and GIVEN[snippet.given][1]
        yield pytest.param(snippet, id=snippet.id, marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("snippet", list(_params()))
def test_snippet_runs(snippet: Snippet, tmp_path, monkeypatch):
    if snippet.given is not None and snippet.given not in GIVEN:
        pytest.fail(f"{snippet.id}: <!-- given: {snippet.given} --> names no GIVEN in tests/test_docs.py "
                    f"(there are {', '.join(GIVEN)})")
    monkeypatch.chdir(tmp_path)
    code = snippet.code
    if not torch.cuda.is_available():
        code = code.replace('"cuda:0"', '"host:0"')
    namespace: dict = {"__name__": "__snippet__", "torch": torch, "harmony_fx": harmony_fx}
    if snippet.given is not None:
        GIVEN[snippet.given][0](namespace)
    exec(compile(code, snippet.id, "exec"), namespace)  # noqa: S102 - the docs' own code


def test_every_marker_is_read_and_names_a_reason_or_a_given():
    """A marker that does not stand right before a ```python fence is a typo the fence would not
    obey (it would run unprepared, or a reason would be lost)."""
    for path in DOCS:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip().startswith("<!--") and re.search(r"not run|given", line):
                assert _MARKER.match(line.strip()), \
                    f"{path.name}:{i + 1}: write <!-- not run: why --> or <!-- given: NAME -->"
                assert i + 1 < len(lines) and lines[i + 1].startswith("```python"), \
                    f"{path.name}:{i + 1}: the marker must be the line right before a ```python fence"
                kind, value = _MARKER.match(line.strip()).groups()
                assert value, f"{path.name}:{i + 1}: say why it is not run, or which GIVEN it takes"
                if kind == "given":
                    assert value in GIVEN, f"{path.name}:{i + 1}: no GIVEN named {value!r}"


def test_the_generated_program_the_readme_shows_is_what_codegen_prints():
    """README: "A generated forward program (an MLP cut into three packs)": each line shown is a line
    of ``hm.code`` for such an MLP, in the same order."""
    from torch import nn

    (shown,) = [code for line, info, code, _ in _fences(ROOT / "README.md")
                if info == "python" and "def forward(self, rt):" in code]
    shown_lines = [line for line in shown.splitlines() if line.strip() and line.strip() != "..."]

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(4))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    hm = harmony_fx.compile(MLP(), (torch.randn(2, 8),), pack_boundaries=(0, 2, 3), microbatches=1)
    code = hm.code.splitlines()
    start = code.index(shown_lines[0])
    assert code[start:start + len(shown_lines)] == shown_lines


# ---------------------------------------------------------------------------- options and environment variables
def _options_table() -> dict[str, str]:
    """docs/options.md's table: option name -> its default column."""
    rows = {}
    for line in (ROOT / "docs" / "options.md").read_text().splitlines():
        match = re.match(r"^\| `(\w+)`(?: \((?:Trainer|`compile`)\))? \| (.*?) \|", line)
        if match:
            rows[match.group(1)] = match.group(2)
    return rows


def _trainer_options() -> dict[str, object]:
    """``harmony_fx.Trainer``'s own keyword options and their defaults."""
    return {name: p.default for name, p in inspect.signature(harmony_fx.Trainer.__init__).parameters.items()
            if p.kind is p.KEYWORD_ONLY}


def test_every_option_is_in_docs_options_and_every_option_there_exists():
    table = _options_table()
    compile_options = set(config.option_names())
    trainer_options = set(_trainer_options())
    assert table, "docs/options.md has no table of options"
    unknown, missing = set(table) - compile_options - trainer_options, compile_options - set(table)
    assert not unknown, f"docs/options.md names options the code does not take: {sorted(unknown)}"
    assert not missing, f"options the code takes that docs/options.md's table leaves out: {sorted(missing)}"
    text = (ROOT / "docs" / "options.md").read_text()
    missing = [name for name in trainer_options if f"`{name}`" not in text]
    assert not missing, f"harmony_fx.Trainer's options that docs/options.md does not name: {missing}"


_LITERAL = re.compile(r'^`?(None|True|False|-?\d+|"\w+")`?(?:\s|$)')


def test_the_defaults_docs_options_states_are_the_codes():
    """A default written as a value (`None`, `True`, `"fp32"`, `0`) is the code's; one written in
    words ("planned", "the device's") is the code's `None`, which means that."""
    defaults = {field.name: field.default for field in dataclasses.fields(config.CompileOptions)}
    defaults.update(_trainer_options())
    for name, stated in _options_table().items():
        literal = _LITERAL.match(stated)
        expected = eval(literal.group(1)) if literal else None  # noqa: S307 - a literal from our own docs
        assert defaults[name] == expected, \
            f"docs/options.md: {name}'s default is {stated!r}, the code's {defaults[name]!r}"


def test_every_option_the_readme_lists_exists():
    readme = (ROOT / "README.md").read_text()
    listed = re.search(r"Options \(every door\): (.*?)See `docs/options.md`", readme, re.S).group(1)
    while re.search(r"\([^()]*\)", listed):  # what the parentheses say about an option is not one
        listed = re.sub(r"\([^()]*\)", "", listed)
    names = set(re.findall(r"`(\w+)`", listed)) - {"Trainer"}
    unknown = names - set(config.option_names())
    assert names and not unknown, f"README lists options harmony_fx does not take: {sorted(unknown)}"


def test_the_environment_variables_the_docs_name_are_the_codes():
    known = set(config.ENVIRONMENT_VARIABLES) | set(config._OTHER_VARIABLES)
    for path in DOCS:
        named = set(re.findall(r"HARMONY_FX_\w+", path.read_text()))
        assert not named - known, f"{path.name} names variables harmony_fx does not read: {named - known}"
    options_md = set(re.findall(r"HARMONY_FX_\w+", (ROOT / "docs" / "options.md").read_text()))
    assert known <= options_md, f"docs/options.md leaves out {known - options_md}"
    for variable, (option, _) in config.ENVIRONMENT_VARIABLES.items():
        assert option in config.option_names(), variable


# ---------------------------------------------------------------------------- the command line
def _commands() -> list[str]:
    """Every ``harmony-fx ...`` command the docs show, in a fence (``$ harmony-fx ...``) or inline."""
    commands = []
    for path in DOCS:
        text = path.read_text()
        commands += re.findall(r"^\$ harmony-fx (.*)$", text, re.M)
        commands += re.findall(r"`(?:\.venv/bin/)?harmony-fx ((?:demo|plan|calibrate)[^`]*)`", text)
        commands += re.findall(r"bin/harmony-fx ((?:demo|plan|calibrate)[^\n`&|]*)", text)
    commands = {" ".join(command.replace("MODEL", "llama-7b").split()) for command in commands}
    return sorted(commands - {"plan"})  # `harmony-fx plan` alone names the command


@pytest.mark.parametrize("command", _commands())
def test_every_command_the_docs_show_parses(command, capsys):
    from harmony_fx.cli import parser

    try:
        parser(exit_on_error=False).parse_args(command.split())
    except SystemExit:
        pytest.fail(f"`harmony-fx {command}` does not parse: {capsys.readouterr().err}")


@pytest.mark.slow
@pytest.mark.parametrize("command", [c for c in _commands() if c.startswith("plan ") and ".py:" not in c])
def test_the_planner_commands_the_docs_show_run(command, capsys, tmp_path, monkeypatch):
    from harmony_fx.cli import main

    monkeypatch.chdir(tmp_path)  # --trace plan.json
    assert main(command.split()) == 0, capsys.readouterr().err
