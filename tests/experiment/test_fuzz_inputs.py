"""Property tests: malformed configs, ``--set`` items, argv lists and damaged checkpoints.

Every malformed input must end in ONE actionable line ``flatbma: error: ...`` on stderr with exit code 2
(or succeed, when the input happens to be valid) — never a Python traceback. At the library level the
only exception a parser or loader may raise is :class:`~flatbma.errors.FlatbmaError`.
"""

from __future__ import annotations

import contextlib
import copy
import io
import itertools
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from flatbma.errors import FlatbmaError
from flatbma.experiment.cli import main
from flatbma.experiment.config.run_config import SECTIONS, RunConfig, load_config
from flatbma.experiment.run.checkpoint import load_checkpoint
from flatbma.experiment.study.plan import load_plan
from flatbma.methods import METHODS
from tests.helpers import DONE, load_state

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))
REAL = {path.name: yaml.safe_load(path.read_text()) for path in CONFIGS}


def fast(max_examples: int) -> settings:
    """Hypothesis settings: no per-example deadline (the first run imports torch), ``max_examples``."""
    return settings(
        deadline=None,
        max_examples=max_examples,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


# Every key a config may hold, so that random documents reach the checks behind the key look-ups.
KEYS = sorted(
    {"seed", "output_dir", "method", "compare", "name", "rho", "rank", *SECTIONS}
    | {f.name for cls in SECTIONS.values() for f in cls.__dataclass_fields__.values()}
)
NASTY_TEXT = ["", " ", "abc", "1e-3", "1.0e3", "∞", "ünïcødé ✓", "a\nb", "a\rb", "x\u2028y", "\x00", "-", "~"]
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),  # unbounded: includes integers far outside 64 bits
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from([*NASTY_TEXT, *METHODS, 10**30, -(10**30), 2**63, 1e308, math.nan, math.inf, -math.inf]),
)
DOCS = st.recursive(
    SCALARS,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6) | st.integers(), children, max_size=5)
    ),
    max_leaves=25,
)


def run_cli(argv: list[str]) -> tuple[Any, str, str]:
    """``main(argv)`` with stdout/stderr captured; any exception other than argparse's ``--help`` exit escapes."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # only --help / -h exit this way (with 0)
            code = e.code
    return code, out.getvalue(), err.getvalue()


def assert_clean(code: Any, err: str, *, ok: bool = True) -> None:
    """Exit 0 or 3 (done; 3: flagged by a health rule) when allowed, or exit 2 with one ``flatbma: error:`` line."""
    if ok and code in DONE:
        return
    lines = err.splitlines()
    assert code == 2, (code, err)
    assert len(lines) == 1 and lines[0].startswith("flatbma: error: "), err
    assert len(lines[0]) > len("flatbma: error: ") + 10, err  # says something


def parse_only(path: Path, overrides: list[str] = ()) -> RunConfig | None:
    """``load_config``: a RunConfig, or None after a FlatbmaError (any other exception escapes)."""
    try:
        return load_config(path, list(overrides))
    except FlatbmaError as e:
        assert str(e).strip(), "empty error message"
        return None


# ---------------------------------------------------------------------------------------------------
# mutations of the real configs


def _entries(node: Any, prefix: tuple = ()) -> list[tuple[dict, Any]]:
    """Every (mapping, key) pair in a nested document."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            found.append((node, key))
            found.extend(_entries(value, (*prefix, key)))
    elif isinstance(node, list):
        for item in node:
            found.extend(_entries(item, prefix))
    return found


BAD_VALUES = st.one_of(
    st.sampled_from(
        [
            *(None, True, False, 0, -1, -7, 2.5, -0.5, 10**30, -(10**30), 2**62, 1e308, math.nan, math.inf, -math.inf),
            *NASTY_TEXT,
            *([1, [2]], [], {}, {"x": 1}, [[[]]], {"name": None}),
        ]
    ),
    st.text(max_size=8),
)


# Values of the right type that only the run can reject (or that train): edge sizes, other names, devices.
EDGE_VALUES = st.sampled_from(
    [3, 1000, 0.999, 1e30, 1e-30, "cpu:0", "meta", "cuda:3", "mfvi", "idx", "cifar10", "cnn", "imagenet", "/no/file"]
)


@st.composite
def mutated(draw: st.DrawFn, sources: dict[str, Any], values: st.SearchStrategy = BAD_VALUES) -> dict[str, Any]:
    """A real config with 1-3 mutations: wrong types, bad numbers, unknown keys, missing sections, nesting."""
    raw = copy.deepcopy(sources[draw(st.sampled_from(sorted(sources)))])
    for _ in range(draw(st.integers(1, 3))):
        entries = _entries(raw)
        if not entries:
            break
        parent, key = draw(st.sampled_from(entries))
        op = draw(st.sampled_from(["set", "set", "set", "delete", "unknown", "wrap", "stringify"]))
        if op == "set":
            parent[key] = copy.deepcopy(draw(values))  # later mutations may edit it
        elif op == "delete":
            del parent[key]
        elif op == "unknown":  # a typo of a real key, or any text
            typo = draw(st.sampled_from([f"{key}s", str(key)[:-1], str(key).upper(), "unknown"]) | st.text(max_size=6))
            parent[typo] = copy.deepcopy(draw(values))
        elif op == "wrap":
            parent[key] = [parent[key]]
        else:  # a number written as text
            parent[key] = str(parent[key])
    return raw


def _cheap(raw: dict[str, Any]) -> dict[str, Any]:
    """A real config moved onto digits + MLP (no download, no pretrained weights), one short epoch."""
    raw = copy.deepcopy(raw)
    raw.pop("compare", None)
    raw.setdefault("method", {"name": "sgd"})
    raw["data"] = {k: v for k, v in raw.get("data", {}).items() if k not in ("root", "image_size")}
    raw["data"].update(name="digits", image_size=8)
    if raw["data"].get("val_pool"):  # CIFAR's 500 per class: digits' smallest training class has 116 images
        raw["data"]["val_pool"] = min(raw["data"]["val_pool"], 20)
    if raw["data"].get("normalize"):  # ImageNet statistics need three channels
        raw["data"]["to_rgb"] = True
    # digits is a classification set: a regression config (model.likelihood: gaussian) moves onto it as a classifier
    dropped = ("pretrained", "likelihood", "noise_std")
    raw["model"] = {k: v for k, v in raw.get("model", {}).items() if k not in dropped} | {"name": "mlp", "width": 16}
    raw["eval"] = {**raw.get("eval", {}), "num_samples": 1}
    if "optim" in raw:  # the one epoch it trains (_forced) is warmed up at most (a longer warm-up is refused)
        raw["optim"] = {**raw["optim"], "warmup_epochs": min(raw["optim"].get("warmup_epochs", 0), 1)}
    return raw


CHEAP = {name: _cheap(raw) for name, raw in REAL.items()}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def test_the_cheap_configs_are_valid_and_train(work: Path) -> None:
    """The unmutated bases of the end-to-end property train (so failures below come from mutations)."""
    for i, raw in enumerate(CHEAP.values()):
        path = work / f"base{i}.yaml"
        path.write_text(yaml.safe_dump(raw))
        code, _, err = run_cli(["train", "--config", str(path), *_forced(work / f"base{i}")])
        assert code in DONE, err


def _forced(out_dir: Path) -> list[str]:
    return [
        *("--set", "train.epochs=1", "--set", "train.progress=false", "--set", "eval.flatness=false"),
        *("--set", f"output_dir={out_dir}", "--force"),
    ]


@fast(150)
@given(doc=DOCS)
def test_random_yaml_documents_parse_or_raise_flatbma_error(work: Path, doc: Any) -> None:
    path = work / "random.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    parse_only(path)


@fast(40)
@given(text=st.text(max_size=200) | st.binary(max_size=200).map(lambda b: b.decode("latin-1")))
def test_random_text_files_parse_or_raise_flatbma_error(work: Path, text: str) -> None:
    path = work / "text.yaml"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    parse_only(path)


@pytest.mark.parametrize(
    "text",
    [
        "[" * 3000 + "]" * 3000,  # nesting deeper than the recursion limit
        "- " * 3000 + "1",
        "seed: " + "9" * 5000,  # an integer Python refuses to convert
        "a: &a [*a, *a]\nmethod: {name: sgd}\n",
        "!!python/object/apply:os.system ['true']\n",
        "method: {name: sgd}\nseed: 2001-01-01\n",
        "\ufeffmethod: {name: sgd}\noptim: {lr: 1e-3}\n",
        "\xff\xfe\x00\x01",
    ],
    ids=["deep-flow", "deep-block", "5000-digits", "alias-cycle", "python-tag", "date", "bom-1e-3", "utf16-bom"],
)
def test_pathological_yaml_is_one_error_line(work: Path, text: str) -> None:
    path = work / "patho.yaml"
    path.write_bytes(text.encode("latin-1") if text.startswith("\xff") else text.encode())
    assert parse_only(path) is None
    assert_clean(*run_cli(["train", "--config", str(path)])[::2], ok=False)


@fast(150)
@given(raw=mutated(REAL))
def test_mutated_real_configs_parse_or_raise_flatbma_error(work: Path, raw: dict[str, Any]) -> None:
    path = work / "mutated.yaml"
    path.write_text(yaml.safe_dump(raw, allow_unicode=True))
    parse_only(path)


@fast(100)
@given(raw=mutated({k: v for k, v in REAL.items() if "compare" in v}), quick=st.booleans())
def test_mutated_compare_configs_parse_or_raise_flatbma_error(work: Path, raw: dict[str, Any], quick: bool) -> None:
    path = work / "compare.yaml"
    path.write_text(yaml.safe_dump(raw, allow_unicode=True))
    try:
        plan = load_plan(path, quick=quick)
    except FlatbmaError:
        return
    assert plan.runs() and plan.fingerprint()


_RUN = itertools.count()


@fast(40)
@given(raw=mutated(CHEAP, EDGE_VALUES | BAD_VALUES))
def test_mutated_configs_train_or_fail_with_one_line(work: Path, raw: dict[str, Any]) -> None:
    path = work / "e2e.yaml"
    path.write_text(yaml.safe_dump(raw, allow_unicode=True))
    out_dir = work / f"e2e{next(_RUN)}"
    code, _, err = run_cli(["train", "--config", str(path), *_forced(out_dir)])
    assert_clean(code, err)
    event(f"exit {code}")  # --hypothesis-show-statistics: how many mutated configs still train
    if code in DONE:
        assert (out_dir / "metrics.json").is_file()
    shutil.rmtree(out_dir, ignore_errors=True)


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("seed=100000000000000000000000", "seed must be"),
        ("seed=-1", "seed must be"),
        ("optim.lr=1e-3", "write 0.001"),
        ("optim.lr=" + "1" * 400, "float range"),
        ("optim.warmup_epochs=.inf", "finite"),
        ("optim.lr=.inf", "finite"),
        ("data.image_size=100000000000000000000", "64-bit"),
        ("method.name=[sgd]", "unknown method"),
        ("method.name={a: 1}", "unknown method"),
        ("output_dir=", "output_dir"),
        ("output_dir=a\x00b", "output_dir"),
        ("train.device=meta", "train.device"),
        ("train.device=mps", "train.device"),
        ("train.device=cuda:99", "train.device"),
        ("data.test_limit=1", "data.test_limit"),
        ("eval.hessian_examples=1", "eval.hessian_examples"),
        ("data.image_size=100000000", "out of memory"),  # allocation beyond any address space fails at once
        ("model.width=1000000000000000", "out of memory"),
        ("data.root=~no_such_user_xyz/data", "root"),
        ("unknown\nkey=1", "unknown config key"),
    ],
)
def test_former_tracebacks_are_one_line_errors(work: Path, override: str, needle: str) -> None:
    """Each of these ended in a traceback before it was fixed where the bad value is first seen."""
    path = work / "digits.yaml"
    path.write_text(yaml.safe_dump(CHEAP["digits-sam.yaml"]))
    code, _, err = run_cli(["train", "--config", str(path), *_forced(work / "former"), "--set", override])
    assert_clean(code, err, ok=False)
    assert needle in err, err


def test_an_unwritable_output_dir_is_one_line_error(work: Path) -> None:
    path = work / "digits.yaml"
    path.write_text(yaml.safe_dump(CHEAP["digits-sam.yaml"]))
    blocker = work / "a_file"
    blocker.write_text("not a directory")
    code, _, err = run_cli(["train", "--config", str(path), *_forced(blocker / "run")])
    assert_clean(code, err, ok=False)
    assert "output_dir" in err


# ---------------------------------------------------------------------------------------------------
# --set items and argv lists (nothing trains: the last override always makes the config invalid)

DOTTED = st.lists(st.sampled_from(KEYS) | st.text(max_size=5), min_size=1, max_size=4).map(".".join)
YAML_GARBAGE = st.sampled_from(
    [
        "[",
        "{a: [1,",
        "]",
        "'",
        '"',
        "!!python/object:os.system {}",
        "!!binary AAAA",
        "&a [*a]",
        "*nope",
        "? a",
        "- a\n- b",
        ".nan",
        "-.inf",
        "~",
        "0x1F",
        "0o17",
        "1_000",
        "1e-3",
        "2001-01-01",
        "[" * 2000,
        "9" * 5000,
        "{" * 50 + "}" * 50,
    ]
)
SET_ITEMS = st.one_of(
    st.tuples(DOTTED, YAML_GARBAGE | st.text(max_size=15) | DOCS.map(lambda d: yaml.safe_dump(d).strip())).map(
        "=".join
    ),
    st.text(max_size=20),  # often without '='
    st.sampled_from(["=", "==", "=1", "a", ".=1", "..=", "method", "method=", "train=", "train.epochs"]),
)


@fast(120)
@given(items=st.lists(SET_ITEMS, max_size=5), base=st.sampled_from(sorted(REAL)))
def test_random_set_items_parse_or_raise_flatbma_error(items: list[str], base: str) -> None:
    parse_only(CONFIGS[sorted(REAL).index(base)], items)


@fast(40)
@given(items=st.lists(SET_ITEMS, max_size=4))
def test_random_set_items_through_main_are_one_line_errors(work: Path, items: list[str]) -> None:
    path = work / "digits.yaml"
    path.write_text(yaml.safe_dump(CHEAP["digits-sam.yaml"]))
    argv = ["train", "--config", str(path), *itertools.chain.from_iterable(("--set", i) for i in items)]
    code, _, err = run_cli([*argv, "--set", "train.epochs=0", "--set", f"output_dir={work / 'never'}"])
    assert_clean(code, err, ok=False)
    assert not (work / "never").exists()


TOKENS = st.sampled_from(
    [
        "train",
        "evaluate",
        "compare",
        "methods",
        "--config",
        "--set",
        "--resume",
        "--force",
        "--quick",
        "--flatness",
        "--help",
        "-h",
        "--",
        "-",
        "--conf",
        "--config=",
        "no/such/config.yaml",
        "no_such_run_dir",
        "seed=1",
        "train.epochs=0",
        "",
    ]
)


@fast(100)
@given(argv=st.lists(TOKENS | st.text(max_size=10), max_size=6))
def test_random_argv_exits_0_or_with_one_error_line(argv: list[str]) -> None:
    code, out, err = run_cli(argv)
    if code in DONE:  # 'methods' or --help
        assert out
    else:
        assert_clean(code, err, ok=False)


# ---------------------------------------------------------------------------------------------------
# damaged checkpoints


@pytest.fixture(scope="module")
def run_dir(work: Path) -> Path:
    path = work / "ckpt.yaml"
    path.write_text(yaml.safe_dump(CHEAP["digits-sam.yaml"] | {"model": {"name": "mlp", "width": 4}}))
    out = work / "ckpt_run"
    code, _, err = run_cli(["train", "--config", str(path), *_forced(out)])
    assert code in DONE, err
    return out


@st.composite
def damaged(draw: st.DrawFn, raw: bytes) -> bytes:
    """Truncation, bit flips (mostly in the JSON header), random header bytes, insertions, a bad length."""
    data = bytearray(raw)
    header_end = 8 + int.from_bytes(raw[:8], "little")
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["truncate", "flip", "flip_header", "byte_header", "insert", "length"]))
        if not data:
            break
        if op == "truncate":
            del data[draw(st.integers(0, len(data) - 1)) :]
        elif op in ("flip", "flip_header"):
            hi = len(data) - 1 if op == "flip" else min(header_end, len(data)) - 1
            data[draw(st.integers(0, hi))] ^= 1 << draw(st.integers(0, 7))
        elif op == "byte_header":
            data[draw(st.integers(0, min(header_end, len(data)) - 1))] = draw(st.integers(0, 255))
        elif op == "insert":
            at = draw(st.integers(0, len(data)))
            data[at:at] = draw(st.binary(min_size=1, max_size=6))
        else:
            data[:8] = draw(st.integers(0, 2**64 - 1)).to_bytes(8, "little")
    return bytes(data)


def test_damaged_checkpoints_raise_only_flatbma_error(run_dir: Path, work: Path) -> None:
    raw = (run_dir / "checkpoint.safetensors").read_bytes()
    bad = work / "bad.safetensors"

    @fast(200)
    @given(data=damaged(raw))
    def check(data: bytes) -> None:
        bad.write_bytes(data)
        try:
            load_checkpoint(bad)
            load_state(bad)
        except FlatbmaError as e:
            assert str(e).strip()

    check()


def test_resume_and_evaluate_from_damaged_checkpoints_are_one_line_errors(run_dir: Path, work: Path) -> None:
    raw = (run_dir / "checkpoint.safetensors").read_bytes()
    copy_dir = work / "damaged_run"

    @fast(20)
    @given(data=damaged(raw), command=st.sampled_from(["evaluate", "resume"]))
    def check(data: bytes, command: str) -> None:
        shutil.rmtree(copy_dir, ignore_errors=True)
        shutil.copytree(run_dir, copy_dir)
        (copy_dir / "checkpoint.safetensors").write_bytes(data)
        argv = ["evaluate", str(copy_dir)] if command == "evaluate" else ["train", "--resume", str(copy_dir)]
        assert_clean(*run_cli(argv)[::2])

    check()


@pytest.mark.parametrize("damage", ["metrics_json", "config_yaml"])
def test_damaged_run_files_are_one_line_errors(run_dir: Path, work: Path, damage: str) -> None:
    copy_dir = work / f"damaged_{damage}"
    shutil.copytree(run_dir, copy_dir, dirs_exist_ok=True)
    if damage == "metrics_json":
        (copy_dir / "metrics.json").write_text('{"accuracy": 0.9')
    else:
        (copy_dir / "config.yaml").write_text("method: [unclosed\n")
    assert_clean(*run_cli(["evaluate", str(copy_dir)])[::2], ok=False)
