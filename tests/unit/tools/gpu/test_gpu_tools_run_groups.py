"""tools/gpu/run_groups.sh: the groups it knows are the ones it documents, and the issue-26 groups
that run commands rather than pytest start what the next lease needs (``python3`` replaced by a
recorder, so nothing runs: the GPU itself is not needed to check the command lines)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

REPO = Path(__file__).resolve().parents[4]
SCRIPT = REPO / "tools" / "gpu" / "run_groups.sh"
ARMS = ("pp1-nospec", "pp1-dspark", "pp2-dspark")


def _case_labels() -> set[str]:
    text = SCRIPT.read_text()
    body = text[text.index('for g in "$@"; do') : text.index("\ndone\nwait")]
    labels = set()
    for m in re.finditer(r"^  ([a-z0-9_ |]+)\)$", body, re.M):
        labels |= {x.strip() for x in m.group(1).split("|")}
    return labels


def test_every_group_is_documented_and_named_when_unknown():
    text = SCRIPT.read_text()
    labels = _case_labels()
    assert {"acceptance", "dsv4_check", "gsm8k_k3", "gsm8k_dsv4", "dsv4k3"} <= labels
    assert {"dsv41_pp", "pd_pp_dsv41", "gsm8k_dsv41"} <= labels
    known = re.search(r"^KNOWN=\(([^)]*)\)", text, re.M).group(1)
    assert set(known.split()) == labels
    header = text[: text.index("set -uo pipefail")]
    for label in labels:
        assert re.search(rf"\b{label}\b", header), f"{label} is not described in the header"


def _fake_run(tmp_path: Path, *groups: str, budget: int = 540, env_keys: tuple[str, ...] = ()):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.txt"
    stub = bin_dir / "python3"
    # one line per call, written at once (groups run side by side): the arguments, shell-quoted,
    # then ``ENV:KEY=value`` for each of ``env_keys`` (what the group set for its command)
    log.write_text("")
    envs = "".join(f' "ENV:{k}=${{{k}-}}"' for k in env_keys)
    stub.write_text(f'#!/bin/bash\nline=$(printf "%q " "$@"{envs})\necho "$line" >> {log}\n')
    stub.chmod(0o755)
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "DSPARK_GPU_GROUPS_BUDGET_S": str(budget),
    }
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(out), *groups],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    calls = [shlex.split(line) for line in log.read_text().splitlines() if line.strip()]
    return proc, calls


def test_issue26_groups_start_the_leases_commands(tmp_path):
    proc, calls = _fake_run(tmp_path, "acceptance", "dsv4_check", "gsm8k_k3", "gsm8k_dsv4")
    rc = (tmp_path / "out" / "rc.txt").read_text()
    work = [c for c in calls if c[:3] != ["-m", "pip", "install"]]
    names = sorted(line.split()[0] for line in rc.splitlines())
    assert names == sorted(
        ["acceptance_k3", "acceptance_dsv4", "dsv4_check"]
        + [f"gsm8k_{f}-{a}" for f in ("k3", "dsv4") for a in ARMS]
    )
    assert all(line.endswith("rc=0") for line in rc.splitlines())
    acc = [c for c in work if c[:2] == ["-m", "benchmarks.tiny_pair_acceptance"]]
    assert len(acc) == 2
    for c in acc:
        fam, pair = c[c.index("--family") + 1], c[c.index("--pair") + 1]
        assert (REPO / pair).is_dir() and c[c.index("--k") + 1] == "7"
        assert int(c[c.index("--timeout") + 1]) * 2 < 540  # both engines inside the budget
        assert c[c.index("--out-json") + 1].endswith(f"{fam}_acceptance.json")
    evals = [c for c in work if c[:4] == ["-m", "dspark_dev", "eval", "gsm8k"]]
    assert len(evals) == 6
    for c in evals:
        config = c[c.index("--config") + 1]
        assert (REPO / config).is_file(), config
        assert ("--launchers" in c) is config.endswith("pp2-dspark.yaml"), c
    check = [c for c in work if c[:2] == ["-m", "dspark_dev.training.dsv4_check"]]
    assert len(check) == 1 and "--spec" in check[0]


def test_pd_pp_groups_run_the_pp_producer_module_for_their_pair(tmp_path):
    """Each PD-with-PP-producer group: its pair, its artifacts folder, and its record folder
    OUTDIR/GROUP (made before it starts: test_pd_pp_producer.py writes pd_pp.json there)."""
    keys = ("DSPARK_GPU_PD_PP_PAIR", "DSPARK_GPU_ARTIFACTS", "DSPARK_GPU_PD_PP_READY_S",
            "DSPARK_GPU_PD_PP_OUT")  # fmt: skip
    groups = ("pd_pp", "pd_pp_dsv4", "pd_pp_k3", "pd_pp_dsv41")
    proc, calls = _fake_run(tmp_path, *groups, env_keys=keys)
    runs = [c for c in calls if "tests/gpu/test_pd_pp_producer.py" in c]
    assert len(runs) == 4, calls
    env = [dict(x[4:].split("=", 1) for x in c if x.startswith("ENV:")) for c in runs]
    assert sorted(e["DSPARK_GPU_PD_PP_PAIR"] for e in env) == ["", "dsv4", "dsv41", "k3"]
    arts = {e["DSPARK_GPU_PD_PP_PAIR"]: e["DSPARK_GPU_ARTIFACTS"] for e in env}
    assert arts["dsv4"].endswith("/pd_pp_dsv4") and arts["k3"].endswith("/pd_pp_k3"), arts
    assert arts["dsv41"].endswith("/pd_pp_dsv41"), arts
    assert all(e["DSPARK_GPU_PD_PP_READY_S"] == "420" for e in env), env
    outs = {e["DSPARK_GPU_PD_PP_PAIR"] or "tiny": e["DSPARK_GPU_PD_PP_OUT"] for e in env}
    group = {"tiny": "pd_pp", "dsv4": "pd_pp_dsv4", "k3": "pd_pp_k3", "dsv41": "pd_pp_dsv41"}
    assert outs == {p: str(tmp_path / "out" / g) for p, g in group.items()}, outs
    assert all((tmp_path / "out" / g).is_dir() for g in groups)
    rc = sorted((tmp_path / "out" / "rc.txt").read_text().splitlines())
    assert rc == sorted(f"{g} rc=0" for g in groups), rc


def _one_module_group(tmp_path, group: str, module: str, out_knob: str) -> tuple[list, dict]:
    """Runs ``group`` (faked) and checks what every one-module PP group shares: its module runs
    once, its launcher logs go to the artifacts' ``group`` folder, its record folder
    OUTDIR/``group`` exists before it starts, and the group's rc line; returns the module's
    command line and environment."""
    keys = ("DSPARK_GPU_PP_LOGS", out_knob, "DSPARK_GPU_PP_READY_S", "DSPARK_GPU_PP_STOCK_READY_S")
    proc, calls = _fake_run(tmp_path, group, env_keys=keys)
    runs = [c for c in calls if module in c]
    assert len(runs) == 1, calls
    env = dict(x[4:].split("=", 1) for x in runs[0] if x.startswith("ENV:"))
    assert env["DSPARK_GPU_PP_LOGS"].endswith(f"/{group}"), env
    assert env[out_knob] == str(tmp_path / "out" / group), env
    assert "--timeout=520" in runs[0]
    assert (tmp_path / "out" / group).is_dir()
    assert (tmp_path / "out" / "rc.txt").read_text().splitlines() == [f"{group} rc=0"]
    return runs[0], env


def test_pp_group_runs_its_module_with_its_record_folder(tmp_path):
    """Group pp (issue 25): tests/gpu/test_pp_one_gpu.py with its launcher logs in the artifacts
    and its record folder OUTDIR/pp (made before it starts: the test writes pp.json there)."""
    _, env = _one_module_group(tmp_path, "pp", "tests/gpu/test_pp_one_gpu.py", "DSPARK_GPU_PP_OUT")
    assert (env["DSPARK_GPU_PP_READY_S"], env["DSPARK_GPU_PP_STOCK_READY_S"]) == ("340", "420")


@pytest.mark.parametrize("ready", [None, "300"], ids=["default-deadline", "knob"])
def test_dsv41_pp_group_runs_its_module_with_its_deadlines_and_record_folder(
    tmp_path, monkeypatch, ready
):
    """Group dsv41_pp (issue 42): tests/gpu/test_dsv41_pp.py with its launcher logs in the
    artifacts, its record folder OUTDIR/dsv41_pp (made before it starts), the plugin's and the
    stock control's start-up deadlines BUDGET - 200 unless DSPARK_GPU_DSV41_PP_READY_S says."""
    monkeypatch.delenv("DSPARK_GPU_DSV41_PP_READY_S", raising=False)
    if ready is not None:
        monkeypatch.setenv("DSPARK_GPU_DSV41_PP_READY_S", ready)
    run, env = _one_module_group(
        tmp_path, "dsv41_pp", "tests/gpu/test_dsv41_pp.py", "DSPARK_GPU_DSV41_PP_OUT"
    )
    assert run[:2] == ["-m", "pytest"], run
    want = ready or "340"
    assert (env["DSPARK_GPU_PP_READY_S"], env["DSPARK_GPU_PP_STOCK_READY_S"]) == (want, want)


@pytest.mark.parametrize("ready", [None, "260"], ids=["default-deadline", "knob"])
def test_dsv4k3_pp_group_start_up_deadline_is_budget_less_200_unless_its_knob_says(
    tmp_path, monkeypatch, ready
):
    """Group dsv4k3_pp: tests/gpu/test_dsv4_k3_pp.py, its record folder OUTDIR/dsv4k3_pp, the
    launchers' start-up deadline BUDGET - 200 unless DSPARK_GPU_DSV4K3_PP_READY_S says (a lease
    short of device time can still give a TP=2 x PP=2 job its start-up)."""
    monkeypatch.delenv("DSPARK_GPU_DSV4K3_PP_READY_S", raising=False)
    if ready is not None:
        monkeypatch.setenv("DSPARK_GPU_DSV4K3_PP_READY_S", ready)
    _, env = _one_module_group(
        tmp_path, "dsv4k3_pp", "tests/gpu/test_dsv4_k3_pp.py", "DSPARK_GPU_DSV4K3_PP_OUT"
    )
    assert env["DSPARK_GPU_PP_READY_S"] == (ready or "340")


def test_gsm8k_dsv41_group_runs_the_three_v41_configs(tmp_path):
    """Group gsm8k_dsv41 (issue 42): the V4.1 pair's three YAMLs, PP=2 through the launchers."""
    proc, calls = _fake_run(tmp_path, "gsm8k_dsv41")
    evals = [c for c in calls if c[:4] == ["-m", "dspark_dev", "eval", "gsm8k"]]
    configs = sorted(c[c.index("--config") + 1] for c in evals)
    assert configs == [f"tests/evals/gsm8k/configs/dsv41-{a}.yaml" for a in sorted(ARMS)], configs
    for c in evals:
        config = c[c.index("--config") + 1]
        assert (REPO / config).is_file(), config
        assert ("--launchers" in c) is config.endswith("pp2-dspark.yaml"), c
        assert c[c.index("--out-json") + 1].endswith(Path(config).stem + ".json"), c
    rc = sorted((tmp_path / "out" / "rc.txt").read_text().splitlines())
    assert rc == sorted(f"gsm8k_dsv41-{a} rc=0" for a in ARMS), rc


def test_tp_pp_group_runs_its_module_with_its_deadlines_and_record_folder(tmp_path):
    _, env = _one_module_group(
        tmp_path, "tp_pp", "tests/gpu/test_tp_pp_one_gpu.py", "DSPARK_GPU_TP_PP_OUT"
    )
    # start-up deadlines inside the budget, with room to serve and stop after them
    assert (env["DSPARK_GPU_PP_READY_S"], env["DSPARK_GPU_PP_STOCK_READY_S"]) == ("370", "390")


def test_pd_tp_pp_group_runs_the_pd_module_with_its_tp_jobs_and_record_folder(tmp_path):
    """Group pd_tp_pp (issue 40 item 2): test_pd_pp_producer.py with only the TP x PP PD job and
    the references by default (the PP=2 jobs of group pd_pp are not started), its record in
    OUTDIR/pd_tp_pp, its own artifacts folder, a start-up deadline inside the budget."""
    keys = ("DSPARK_GPU_PD_PP_JOBS", "DSPARK_GPU_PD_TP_PP_OUT", "DSPARK_GPU_ARTIFACTS",
            "DSPARK_GPU_PD_PP_READY_S", "DSPARK_GPU_PD_PP_PAIR")  # fmt: skip
    proc, calls = _fake_run(tmp_path, "pd_tp_pp", env_keys=keys)
    runs = [c for c in calls if "tests/gpu/test_pd_pp_producer.py" in c]
    assert len(runs) == 1, calls
    env = dict(x[4:].split("=", 1) for x in runs[0] if x.startswith("ENV:"))
    assert env["DSPARK_GPU_PD_PP_JOBS"] == "pair_baseline,pair_spec,pd_tp2pp2_tp2", env
    assert env["DSPARK_GPU_PD_TP_PP_OUT"] == str(tmp_path / "out" / "pd_tp_pp"), env
    assert env["DSPARK_GPU_ARTIFACTS"].endswith("/pd_tp_pp") and env["DSPARK_GPU_PD_PP_PAIR"] == ""
    assert env["DSPARK_GPU_PD_PP_READY_S"] == "420" and "--timeout=520" in runs[0]
    assert (tmp_path / "out" / "rc.txt").read_text().splitlines() == ["pd_tp_pp rc=0"]


def test_a_misspelt_group_fails_the_call_before_anything_starts(tmp_path):
    proc, calls = _fake_run(tmp_path, "acceptance", "gsm8k_k4")
    assert proc.returncode == 2 and "unknown group 'gsm8k_k4'" in proc.stderr
    assert calls == [] and not (tmp_path / "out").exists()


def test_tap_partials_group_runs_the_pp_module_with_its_opt_in_jobs(tmp_path, monkeypatch):
    """Group tap_partials (issue 44 item 4): test_pp_one_gpu.py with the raw-tap PP=3 job, the
    two tap-partials jobs and their control (not started by the pp group) and the references, its
    own record folder and artifacts."""
    monkeypatch.delenv("DSPARK_GPU_TAP_PARTIALS_JOBS", raising=False)
    monkeypatch.setenv("DSPARK_GPU_PP_JOBS", "ref")  # the pp group's setting is not taken
    keys = ("DSPARK_GPU_PP_JOBS", "DSPARK_GPU_PP_LOGS", "DSPARK_GPU_PP_OUT")
    proc, calls = _fake_run(tmp_path, "tap_partials", env_keys=keys)
    runs = [c for c in calls if "tests/gpu/test_pp_one_gpu.py" in c]
    assert len(runs) == 1, calls
    env = dict(x[4:].split("=", 1) for x in runs[0] if x.startswith("ENV:"))
    jobs = env["DSPARK_GPU_PP_JOBS"].split(",")
    want = ["ref", "pp1_async", "pp3_async", "pp3_taps_dict", "pp3_taps_side", "pp3_taps_wrong"]
    assert jobs == want, env

    module = (REPO / "tests" / "gpu" / "test_pp_one_gpu.py").read_text()
    assert all(f'"{j}"' in module for j in jobs), jobs  # jobs the module knows
    assert 'TAP_JOBS = {"pp3_taps_dict": "1", "pp3_taps_side": "side"}' in module
    assert env["DSPARK_GPU_PP_LOGS"].endswith("/tap_partials")
    assert env["DSPARK_GPU_PP_OUT"] == str(tmp_path / "out" / "tap_partials")
    assert (tmp_path / "out" / "rc.txt").read_text().splitlines() == ["tap_partials rc=0"]


@pytest.mark.parametrize("override", [None, "250"])
def test_tap_partials_start_up_deadline_follows_the_budget_unless_set(
    tmp_path, monkeypatch, override
):
    """A short lease runs the group under a smaller budget; its start-up deadline is BUDGET - 200
    unless DSPARK_GPU_TAP_PARTIALS_READY_S names it (the side-channel job took 136 s to be ready
    on an H200, more than a 300 s budget's 100 s)."""
    if override is None:
        monkeypatch.delenv("DSPARK_GPU_TAP_PARTIALS_READY_S", raising=False)
    else:
        monkeypatch.setenv("DSPARK_GPU_TAP_PARTIALS_READY_S", override)
    proc, calls = _fake_run(
        tmp_path, "tap_partials", budget=320, env_keys=("DSPARK_GPU_PP_READY_S",)
    )
    runs = [c for c in calls if "tests/gpu/test_pp_one_gpu.py" in c]
    assert len(runs) == 1, (proc.stderr, calls)
    env = dict(x[4:].split("=", 1) for x in runs[0] if x.startswith("ENV:"))
    assert env["DSPARK_GPU_PP_READY_S"] == (override or "120")


def _serial_run(tmp_path, serial_s: int | None, min_s: int = 10, sleep_s: int = 2):
    """pd_pp_dsv4 then pd_pp_dsv41, with DSPARK_GPU_GROUPS_SERIAL_S (``None``: unset): a python3
    recorder that takes ``sleep_s`` seconds a pytest call and logs its start and end times with
    its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.txt"
    log.write_text("")
    (bin_dir / "python3").write_text(
        "#!/bin/bash\n"
        f'case "$*" in *pytest*) start=$(date +%s.%N); sleep {sleep_s}; '
        f'echo "$start $(date +%s.%N) $DSPARK_GPU_PD_PP_PAIR $*" >> {log};; esac\n'
    )
    (bin_dir / "python3").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSPARK_GPU_GROUPS_")}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", DSPARK_GPU_GROUPS_BUDGET_S="430")
    if serial_s is not None:
        env.update(DSPARK_GPU_GROUPS_SERIAL_S=str(serial_s), DSPARK_GPU_GROUPS_MIN_S=str(min_s))
    out = tmp_path / "out"
    subprocess.run(
        ["bash", str(SCRIPT), str(out), "pd_pp_dsv4", "pd_pp_dsv41"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    rows = sorted(
        (line.split() for line in log.read_text().splitlines() if line.strip()),
        key=lambda r: float(r[0]),
    )
    return rows, (out / "rc.txt").read_text()


def _timeout(row):
    return int(next(a for a in row if a.startswith("--timeout=")).split("=")[1])


def test_serial_groups_run_one_after_another_under_what_is_left_of_the_call(tmp_path):
    rows, rc = _serial_run(tmp_path, serial_s=300)
    assert [r[2] for r in rows] == ["dsv4", "dsv41"], rows
    first, second = rows
    assert float(second[0]) >= float(first[1]), "the second group started before the first ended"
    # the call's 300 s cap the first group's 430 s budget (430 - 20 without the cap); the second
    # gets what is left. The script counts whole seconds from its start: on a loaded machine the
    # first group may start a second or two into the call (279 once, in a full run)
    assert 300 - 20 - 3 <= _timeout(first) <= 300 - 20
    assert _timeout(second) <= 300 - 2 - 20
    assert rc.splitlines() == ["pd_pp_dsv4 rc=0", "pd_pp_dsv41 rc=0"]


def test_a_serial_group_without_enough_of_the_call_left_is_not_started(tmp_path):
    rows, rc = _serial_run(tmp_path, serial_s=300, min_s=299)
    assert [r[2] for r in rows] == ["dsv4"], rows
    lines = rc.splitlines()
    assert lines[0] == "pd_pp_dsv4 rc=0"
    assert lines[1].startswith("pd_pp_dsv41 rc=not-started (")
    assert "under DSPARK_GPU_GROUPS_MIN_S=299" in lines[1]


def test_without_serial_the_groups_start_side_by_side(tmp_path):
    """The control: DSPARK_GPU_GROUPS_SERIAL_S unset, the two groups overlap, each its budget."""
    rows, rc = _serial_run(tmp_path, serial_s=None)
    assert sorted(r[2] for r in rows) == ["dsv4", "dsv41"], rows
    first, second = rows
    assert float(second[0]) < float(first[1]), (
        "side by side, the second starts before the first ends"
    )
    assert _timeout(first) == _timeout(second) == 430 - 20
    assert sorted(rc.splitlines()) == sorted(["pd_pp_dsv4 rc=0", "pd_pp_dsv41 rc=0"])
