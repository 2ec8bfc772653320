"""Acceptance: moed installs the way the docs say, on a copy of the checkout, in fresh venvs.

- test_readme_install_line: README's "Install" one-liner into a new venv, then
  `moed model init` and `moed serve` from that venv (no test extras): /ready, a completion,
  a streamed completion, SIGTERM exits 0.
- test_systemd_wheel_install: systemd/README.md's venv + wheel commands (into a scratch dir
  instead of /opt/moed): the unit's venv has no transformers and no test tools.
- test_model_init_without_init_extra: `moed model init` without transformers is one clear line.

The first two are slow (marked `slow` and `install`: a venv and torch each, 1-2 min apiece on
this project's 2-core machines) and run in `make test`; `-m "not install"` leaves them out.
When both are selected, the systemd flow runs on a second thread while the README test runs
(each pip is one core's work; side by side they take ~45 s less of the suite), and the systemd
test reports its result. The README test's server uses this user's kernel
cache (moed/model/kernels: the name hashes every source file and header, so a hit means the
wheel's sources are the checkout's; test_cpu_kernels covers building).
They need PyPI (or pip's cache for every package the docs' lines install).
Where pip's own config already resolves `torch==2.13.0` to a CPU build (this project's
machines reach PyPI only: a local `torch-2.13.0+cpu` through find-links), the docs'
`--index-url https://download.pytorch.org/whl/cpu` is dropped; anywhere else it is kept.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from moed_server import ServerProcess, _wait_ready, free_port

ROOT = Path(__file__).resolve().parents[2]
PYTORCH_CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"
# What only the test extra brings; none may be in an environment the docs install.
TEST_ONLY = {"pytest", "pytest-asyncio", "pytest-timeout", "hypothesis", "openai"}
INSTALL_TIMEOUT = 480     # one pip command (a torch install from PyPI alone can take minutes)

# ---------------------------------------------------------------- helpers
def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without anything that points at the test venv or moed's."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MOED_") and k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    # PIP_NO_COMPILE=0 is pip's --no-compile (a "no-" option's variable takes a false value):
    # byte-compiling torch's 5,000 modules was half of each install's time, and what is
    # installed is the same (Python compiles what it imports when it imports it).
    env.update({"PYTHONNOUSERSITE": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
                "PIP_NO_COMPILE": "0", "OMP_NUM_THREADS": "1"})
    env.update(extra)
    return env


def _run(cmd: str | list[str], cwd: Path, timeout: float = INSTALL_TIMEOUT,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    shell = isinstance(cmd, str)
    t0 = time.monotonic()
    p = subprocess.run(["bash", "-euo", "pipefail", "-c", cmd] if shell else cmd, cwd=cwd,
                       env=env or _clean_env(), capture_output=True, text=True, timeout=timeout)
    took = time.monotonic() - t0
    print(f"[{took:5.1f} s] rc={p.returncode} {cmd if shell else shlex.join(cmd)}")
    assert p.returncode == 0, (f"{cmd!r} exited {p.returncode} after {took:.0f} s:\n"
                               f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def _copy_checkout(dst: Path) -> Path:
    """What a fresh clone has: tracked files plus untracked, not-ignored ones (no .venv, no
    demo-model, no build output), as they are in the working tree now."""
    dst.mkdir(parents=True)
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
        files = [f for f in out.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = []
    if not files:    # not a git checkout (a source tarball): everything but the usual outputs
        shutil.copytree(ROOT, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
            ".git", ".venv", "demo-model", "build", "dist", "*.egg-info", "__pycache__",
            ".pytest_cache", ".hypothesis", ".cache"))
        return dst
    for f in files:
        src = ROOT / f
        if src.is_file():       # a tracked file deleted in the working tree is skipped
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f)
    return dst


_LOCAL_CPU_TORCH: dict[str, bool] = {}


def _local_cpu_torch(spec: str, python: Path, tmp: Path) -> bool:
    """Does pip's own config (no extra index) resolve `spec` to a +cpu build here?"""
    if spec not in _LOCAL_CPU_TORCH:
        report = tmp / "torch-dry-run.json"
        p = subprocess.run([str(python), "-m", "pip", "install", "--dry-run", "--ignore-installed",
                            "--no-deps", "-q", "--report", str(report), spec],
                           env=_clean_env(), capture_output=True, text=True, timeout=300)
        ok = False
        if p.returncode == 0 and report.exists():
            versions = [i["metadata"]["version"] for i in json.loads(report.read_text())["install"]]
            ok = bool(versions) and all("+cpu" in v for v in versions)
        _LOCAL_CPU_TORCH[spec] = ok
    return _LOCAL_CPU_TORCH[spec]


def _for_here(cmd: str, python: Path, tmp: Path) -> str:
    """The docs' command as this machine can run it (see the module docstring)."""
    if PYTORCH_CPU_INDEX in cmd:
        spec = re.search(r"torch==[\w.+]+", cmd)
        assert spec, cmd
        if _local_cpu_torch(spec.group(0), python, tmp):
            cmd = cmd.replace(" " + PYTORCH_CPU_INDEX, "")
    return cmd


def _sh_blocks(text: str) -> list[str]:
    return re.findall(r"```sh\n(.*?)```", text, flags=re.S)


def _section(text: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert m, f"no '## {title}' section"
    return m.group(1)


def _installed(python: Path) -> dict[str, str]:
    p = _run([str(python), "-m", "pip", "list", "--format=json"], cwd=python.parent, timeout=120)
    return {d["name"].lower().replace("_", "-"): d["version"] for d in json.loads(p.stdout)}


def _extras(cmd: str) -> set[str]:
    m = re.search(r"\[([\w,\s-]+)\]'?\s*$", cmd.strip())
    return {e.strip() for e in m.group(1).split(",")} if m else set()


def _check_env(pkgs: dict[str, str], extras: set[str]) -> None:
    assert not TEST_ONLY & set(pkgs), f"test-only packages installed: {sorted(TEST_ONLY & set(pkgs))}"
    assert ("transformers" in pkgs) == ("init" in extras), (extras, pkgs.get("transformers"))
    assert ("nixl" in pkgs) == ("nixl" in extras), (extras, pkgs.get("nixl"))
    assert pkgs.get("torch", "").split("+")[0] == "2.13.0", pkgs.get("torch")
    cuda = sorted(n for n in pkgs if n.startswith(("nvidia-", "triton", "cuda-")))
    assert not cuda, f"a CPU install pulled the CUDA stack: {cuda}"
    assert "moed" in pkgs


def _check_installed_moed(python: Path, cwd: Path, src: Path) -> None:
    """moed is imported from site-packages (not the checkout), with its kernels' C source."""
    p = _run([str(python), "-c", "import moed, moed.model.kernels as k; "
              "print(moed.__file__); print(k.SOURCE.exists() and all(h.exists() for h in k.HEADERS))"],
             cwd=cwd, timeout=120)
    path, has_c = p.stdout.split()
    assert "site-packages" in path and not Path(path).is_relative_to(src), path
    assert has_c == "True", "the wheel lacks moed/model/kernels/*.c or *.h"


# ---------------------------------------------------------------- tests
@pytest.mark.slow
@pytest.mark.install
@pytest.mark.timeout(900)
def test_readme_install_line(tmp_path: Path) -> None:
    section = _section((ROOT / "README.md").read_text(), "Install")
    lines = [ln.strip() for b in _sh_blocks(section) for ln in b.splitlines()
             if ln.strip().startswith("pip install torch==")]
    assert len(lines) == 1, f"README's Install section should have one install line, has {lines}"
    line = lines[0]
    assert line.index("pip install torch==") < line.index("pip install '."), "torch goes first"

    src = _copy_checkout(tmp_path / "src")
    venv = tmp_path / "v"
    try:
        _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path, timeout=120)
        py = venv / "bin" / "python"
        here = _for_here(line, py, tmp_path)
        cmd = re.sub(r"(^|&&\s*)pip ", lambda m: f"{m.group(1)}{venv}/bin/pip ", here)
        _run(cmd, cwd=src)

        pkgs = _installed(py)
        _check_env(pkgs, _extras(line))
        work = tmp_path / "work"        # outside the checkout: nothing imports from src/
        work.mkdir()
        _check_installed_moed(py, work, src)
        if "nixl" in _extras(line):
            _run([str(py), "-c", "import nixl; from nixl._api import nixl_agent, nixl_agent_config"],
                 cwd=work, timeout=120)

        from moed.model import kernels
        env = _clean_env(MOED_CACHE_DIR=str(tmp_path / "cache"),
                         MOED_KERNEL_CACHE=str(kernels._cache_dir()), MOED_ENGINE_NUM_THREADS="1",
                         PYTHONUNBUFFERED="1")
        model = work / "demo-model"
        _run([str(venv / "bin" / "moed"), "model", "init", "--arch", "qwen3_moe", "--preset", "tiny",
              "--out", str(model)], cwd=work, env=env, timeout=300)
        assert (model / "config.json").exists()

        port = free_port()
        argv = [str(venv / "bin" / "moed"), "serve", "--config", str(src / "conf" / "moed.toml"),
                "--model", str(model), "--host", "127.0.0.1", "--port", str(port)]
        log_path = tmp_path / "serve.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        srv = ServerProcess(f"http://127.0.0.1:{port}", port, proc, log_path, argv)
        try:
            _wait_ready(srv, "/ready", time.monotonic() + 180)
            status, body = srv.get("/v1/models")
            assert status == 200, body
            name = json.loads(body)["data"][0]["id"]
            assert name == "demo-model", body

            def post(payload: dict) -> tuple[int, bytes]:
                req = urllib.request.Request(srv.url + "/v1/completions",
                                             data=json.dumps(payload).encode(),
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=120) as r:
                    return r.status, r.read()

            status, raw = post({"model": name, "prompt": "def fib(n):", "max_tokens": 8})
            out = json.loads(raw)
            assert status == 200 and isinstance(out["choices"][0]["text"], str), out
            assert out["usage"]["completion_tokens"] >= 1, out
            status, raw = post({"model": name, "prompt": "Hello", "max_tokens": 4, "stream": True})
            events = [ln for ln in raw.decode().splitlines() if ln.startswith("data: ")]
            assert status == 200 and events and events[-1] == "data: [DONE]", raw[-500:]
            assert srv.stop(signal.SIGTERM, timeout=45) == 0, srv.tail()
        finally:
            if srv.alive:
                srv.stop(signal.SIGKILL, timeout=5)
            print(f"serve log tail:\n{srv.tail(15)}")
    finally:
        shutil.rmtree(venv, ignore_errors=True)     # ~1.7 GB


def _systemd_cmds() -> list[str]:
    section = _section((ROOT / "systemd" / "README.md").read_text(), "Install")
    blocks = _sh_blocks(section)
    assert blocks, "systemd/README.md's Install section has no sh block"
    cmds = [ln.split("  #")[0].strip() for ln in blocks[0].splitlines()
            if "/opt/moed" in ln and not ln.lstrip().startswith("#")]
    assert len(cmds) == 4 and "venv" in cmds[0], cmds
    assert "torch==" in cmds[1] and "wheel" in cmds[2] and ".whl" in cmds[3], cmds
    return cmds


def _systemd_flow(tmp: Path, model: Path) -> None:
    """systemd/README.md's four install commands, /opt/moed made `tmp`/opt-moed, then what the
    unit needs of that venv."""
    cmds = _systemd_cmds()
    src = _copy_checkout(tmp / "src")
    opt = tmp / "opt-moed"
    try:
        for cmd in cmds:
            cmd = cmd.replace("/opt/moed", str(opt))
            cmd = re.sub(r"^python3 ", shlex.quote(sys.executable) + " ", cmd)
            _run(_for_here(cmd, opt / "bin" / "python", tmp), cwd=src)
        wheels = sorted(p.name for p in (src / "dist").glob("*.whl"))
        named = re.search(r"dist/(moed-[^\s'\[]+\.whl)", cmds[3]).group(1)
        assert wheels == [named], f"the docs install {named}, pip built {wheels}"

        py = opt / "bin" / "python"
        _check_env(_installed(py), _extras(cmds[3]))
        work = tmp / "work"
        work.mkdir()
        _check_installed_moed(py, work, src)
        # What the unit runs, short of serving (test_readme_install_line serves): the config the
        # docs install is valid with the unit's credentials (and a checkpoint: the unit's venv
        # cannot make one), and the KV transfer backend of a decode node imports.
        creds = tmp / "credentials"     # as the docs write them; the unit's Environment=
        creds.mkdir(mode=0o700)
        for name, text in (("api-keys", "key-1\n"), ("admin-token", "token-1\n"),
                           ("cluster-key", os.urandom(32).hex() + "\n")):
            (creds / name).write_text(text)
            (creds / name).chmod(0o600)
        _run([str(opt / "bin" / "moed"), "check-config", str(src / "conf" / "decode.toml"),
              "--model", str(model)],
             cwd=work, timeout=120, env=_clean_env(
                 MOED_SERVER_API_KEYS_FILE=str(creds / "api-keys"),
                 MOED_SERVER_ADMIN_TOKEN_FILE=str(creds / "admin-token"),
                 MOED_CLUSTER_KEY_FILE=str(creds / "cluster-key")))
        _run([str(py), "-c", "import nixl; from nixl._api import nixl_agent, nixl_agent_config"],
             cwd=work, timeout=120)
        p = subprocess.run([str(opt / "bin" / "moed"), "model", "init", "--arch", "qwen3_moe",
                            "--out", str(work / "m")], cwd=work, env=_clean_env(),
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and "pip install '.[init]'" in p.stderr, (p.returncode, p.stderr)
        assert "Traceback" not in p.stderr, p.stderr
    finally:
        shutil.rmtree(opt, ignore_errors=True)


@pytest.fixture(scope="module", autouse=True)
def _systemd_ahead(request, tmp_path_factory):
    """With both install tests selected, the systemd flow starts now on a thread (see the module
    docstring); test_systemd_wheel_install takes its result."""
    names = {item.name for item in request.session.items if item.module is request.module}
    if not {"test_readme_install_line", "test_systemd_wheel_install"} <= names:
        yield None
        return
    model = request.getfixturevalue("tiny_qwen3")
    with ThreadPoolExecutor(1, thread_name_prefix="systemd-install") as pool:
        fut = pool.submit(_systemd_flow, tmp_path_factory.mktemp("systemd-install"), model)
        try:
            yield fut
        finally:
            fut.exception(timeout=INSTALL_TIMEOUT * 3)      # not left running past the module


@pytest.mark.slow
@pytest.mark.install
@pytest.mark.timeout(900)
def test_systemd_wheel_install(tmp_path: Path, tiny_qwen3: Path, _systemd_ahead: Future | None) -> None:
    if _systemd_ahead is None:
        _systemd_flow(tmp_path, tiny_qwen3)
    else:
        _systemd_ahead.result(timeout=INSTALL_TIMEOUT * 3)


_BLOCK_TRANSFORMERS = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name == "transformers" or name.startswith("transformers."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _Block())
from moed.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_model_init_without_init_extra(tmp_path: Path) -> None:
    """Without transformers, `moed model init` says what to install (one line, exit 2) and
    leaves --out alone; serving never needed it."""
    out = tmp_path / "m"
    p = subprocess.run([sys.executable, "-c", _BLOCK_TRANSFORMERS, "model", "init", "--arch",
                        "qwen3_moe", "--out", str(out)], cwd=ROOT, env=_clean_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert p.stderr.strip().splitlines() == [
        "moed: model init needs transformers (moed's init extra; serving does not): "
        "pip install '.[init]' in moed's checkout, or pip install 'transformers>=4.51'"], p.stderr
    assert not out.exists()
