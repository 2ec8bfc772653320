"""docs/cluster.md, "One host", run as written: the blocks marked `<!-- one-host: NAME -->`.

Each block runs with `bash -c`, in document order, from the top of a scratch directory that
holds a copy of conf/router.toml, conf/prefill.toml, conf/decode.toml and a link to .venv (the
"setup" block builds demo-model/ there, as on a fresh clone). What the test changes, and
nothing else (the guide's last paragraph says the same):
- the environment: MOED_* variables dropped, OMP_NUM_THREADS=1 added (five nodes, two cores);
- the ports, only when one of the guide's ten is taken here: all ten moved by one offset, in
  the blocks and in the conf copies alike (CLUSTER_GUIDE_PORT_OFFSET=N forces an offset).
It reruns "cluster" and "request" where the guide says "again". Every process the blocks
start (found by process group, killed by pid) is stopped at the end, also when a step fails.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "cluster.md"
STEPS = ("setup", "start", "wait", "cluster", "request", "stream", "metrics", "drain",
         "restart", "stop")
HTTP_PORTS = (8000, 8100, 8101, 8200, 8201)           # the guide's table
GOSSIP_PORTS = (7946, 7947, 7948, 7949, 7950)
ROLES = ["decode", "decode", "prefill", "prefill", "router"]
READY_S = 240.0          # five nodes loading the tiny model on two busy cores: ~150 s at worst

pytestmark = pytest.mark.timeout(720)


def guide_blocks(text: str) -> list[tuple[str, str]]:
    """(name, script) of every marked ```sh block, in document order."""
    return re.findall(r"^<!-- one-host: ([\w-]+) -->\n```sh\n(.*?)\n```$", text, re.S | re.M)


def _free(port: int) -> bool:
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        with socket.socket(socket.AF_INET, kind) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def port_offset() -> int:
    if os.environ.get("CLUSTER_GUIDE_PORT_OFFSET"):
        return int(os.environ["CLUSTER_GUIDE_PORT_OFFSET"])
    for offset in (0, *range(10000, 20001, 1000)):        # all below the ephemeral range
        if all(_free(p + offset) for p in HTTP_PORTS + GOSSIP_PORTS):
            return offset
    pytest.fail("no free range for the guide's ten ports")


def shift_ports(text: str, offset: int) -> str:
    """Every one of the guide's ports (a whole number, not part of an address or another
    number) moved by `offset`."""
    if not offset:
        return text
    ports = "|".join(map(str, HTTP_PORTS + GOSSIP_PORTS))
    return re.sub(rf"(?<![\w.])({ports})(?!\w)", lambda m: str(int(m.group(1)) + offset), text)


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, process group) of a process, None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[0], int(fields[2])


class Guide:
    """Runs blocks; remembers the process group of each (its own session) for the cleanup."""

    def __init__(self, cwd: Path, offset: int) -> None:
        self.cwd, self.offset = cwd, offset
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("MOED_")}
        self.env["OMP_NUM_THREADS"] = "1"
        self.groups: set[int] = set()
        self.blocks = dict(guide_blocks(DOC.read_text()))

    def run(self, name: str, timeout: float) -> str:
        script = shift_ports(self.blocks[name], self.offset)
        p = subprocess.Popen(["bash", "-c", script], cwd=self.cwd, env=self.env,
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.groups.add(p.pid)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate(timeout=10)
            pytest.fail(f"block {name!r} ran over {timeout:.0f} s\n{self.logs()}\n"
                        f"stdout: {out[-2000:]}\nstderr: {err[-2000:]}")
        assert p.returncode == 0, (f"block {name!r} exited {p.returncode}\nstdout: {out[-2000:]}"
                                   f"\nstderr: {err[-2000:]}\n{self.logs()}")
        return out

    def until(self, name: str, check, timeout: float) -> str:
        """Rerun a read-only block until `check(output)` holds (gossip takes a moment)."""
        deadline = time.monotonic() + timeout
        while True:
            out = self.run(name, 30)
            if check(out) or time.monotonic() > deadline:
                return out
            time.sleep(0.5)

    def logs(self, lines: int = 12) -> str:
        out = []
        for log in sorted((self.cwd / "run").glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {log.name}\n" + "\n".join(tail))
        return "\n".join(out)

    def processes(self) -> list[int]:
        """Live processes in the blocks' process groups (the nodes, a leftover sleep)."""
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                st = _proc_stat(int(entry.name))
                if st is not None and st[0] != "Z" and st[1] in self.groups:
                    pids.append(int(entry.name))
        return pids

    def kill_all(self) -> None:
        for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
            pids = self.processes()
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while self.processes() and time.monotonic() < deadline:
                time.sleep(0.2)


def members(out: str) -> list[tuple[str, str, str, str]]:
    """The "cluster" block prints `name role state http` per member."""
    return [tuple(line.split()) for line in out.splitlines() if len(line.split()) == 4]


def test_guide_one_host_section_runs_as_written(tmp_path: Path) -> None:
    text = DOC.read_text()
    assert [name for name, _ in guide_blocks(text)] == list(STEPS)
    for port in HTTP_PORTS + GOSSIP_PORTS:                # the table the test shifts
        assert f"127.0.0.1:{port}" in text, port
    offset = port_offset()
    repo = tmp_path / "repo"
    (repo / "conf").mkdir(parents=True)
    for role in ("router", "prefill", "decode"):
        conf = (ROOT / "conf" / f"{role}.toml").read_text()
        (repo / "conf" / f"{role}.toml").write_text(shift_ports(conf, offset))
    (repo / ".venv").symlink_to(ROOT / ".venv")
    guide = Guide(repo, offset)
    urls = {f"http://127.0.0.1:{p + offset}" for p in HTTP_PORTS}
    decode2 = f"http://127.0.0.1:{8201 + offset}"

    def five_alive(out: str) -> bool:
        ms = members(out)
        return sorted(m[1] for m in ms if m[2] == "alive") == ROLES and \
            {m[3] for m in ms} == urls

    try:
        guide.run("setup", 180)
        assert len(bytes.fromhex((repo / "run/cluster.key").read_text().strip())) == 32
        assert (repo / "run").stat().st_mode & 0o777 == 0o700
        assert (repo / "demo-model/config.json").is_file()

        guide.run("start", 30)
        assert len(list((repo / "run").glob("*.pid"))) == 5
        assert guide.run("wait", READY_S).count(" ready") == 5
        out = guide.until("cluster", five_alive, 30)
        assert five_alive(out), out

        done = json.loads(guide.run("request", 120))
        assert done["object"] == "text_completion" and done["model"] == "demo-model", done
        assert 1 <= done["usage"]["completion_tokens"] <= 16 and done["usage"]["prompt_tokens"]
        stream = guide.run("stream", 120)
        assert "chat.completion.chunk" in stream and stream.rstrip().endswith("data: [DONE]")
        jobs = sum(float(line.split()[-1]) for line in guide.run("metrics", 30).splitlines()
                   if 'result="done"' in line)
        assert jobs >= 2, "both requests were prefilled by a prefill node"

        drained = guide.run("drain", 90)
        assert '"status": "draining"' in drained and "decode-2 exited" in drained
        out = guide.until("cluster", lambda o: (decode2 in {m[3] for m in members(o)
                                                            if m[2] == "left"}), 15)
        assert sorted(m[1] for m in members(out) if m[2] == "alive") == [
            "decode", "prefill", "prefill", "router"], out
        again = json.loads(guide.run("request", 120))     # served by decode-1
        assert again["usage"]["completion_tokens"] >= 1, again

        assert "decode-2 ready" in guide.run("restart", READY_S)
        out = guide.until("cluster", five_alive, 30)
        assert five_alive(out), out

        assert "all stopped" in guide.run("stop", 90)
        assert not guide.processes()
        for name in ("router", "prefill-1", "prefill-2", "decode-1", "decode-2"):
            log = (repo / "run" / f"{name}.log").read_text()
            assert log.count('"event": "stopped"') == (2 if name == "decode-2" else 1), name
    finally:
        guide.kill_all()
        leftover = guide.processes()
        assert not leftover, f"processes left behind: {leftover}"
