"""The run directory: where a run's agents keep what an operator reads.

Layout (one directory per run, shared by the agents of that run when they
share a filesystem)::

    <run_dir>/token                      the run's secret, mode 0600
    <run_dir>/events.jsonl               agents' events, one JSON object a line
    <run_dir>/incidents/<id>.json        one file per incident, with evidence
    <run_dir>/nodes/<node>/status.json   the node's live status, rewritten each second
    <run_dir>/nodes/<node>/ledger.json   the node's goodput ledger, saved each second
    <run_dir>/nodes/<node>/agent.lock    held (flock) by the node's running agent
    <run_dir>/nodes/<node>/pids.json     the agent's and its workers' pids, for the next agent's sweep
    <run_dir>/nodes/<node>/launch.json   the agent's command line, settings and versions (no secret)
    <run_dir>/nodes/<node>/g<G>/rank<R>.log         worker stdout and stderr
    <run_dir>/nodes/<node>/g<G>/rank<R>.error.json  worker's uncaught exception
    <run_dir>/nodes/<node>/g<G>/rank<R>.stacks.txt  faulthandler dumps
    <run_dir>/nodes/<node>/g<G>/control.json        stop request for the workers

The unix sockets (the control socket, the workers' heartbeat sockets) live
in the node directory, or, when its path is too long for a socket's, in a
private directory the agent makes under the system temp dir: a random name
(``mkdtemp``: created by this call, owned by the agent's user, mode 0700),
so another user on the host cannot have made it first and put a socket of
theirs in it.  Clients find a socket through ``status.json`` (the control
socket) or the environment (a worker's heartbeat socket), never by name.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import ConfigError
from .sockets import SOCKET_PATH_LIMIT


@dataclass(frozen=True)
class RunDir:
    """Paths of one run directory, seen from one node."""

    root: Path
    node_id: str

    @property
    def events(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def token_file(self) -> Path:
        return self.root / "token"

    @property
    def incidents(self) -> Path:
        return self.root / "incidents"

    @property
    def node_dir(self) -> Path:
        return self.root / "nodes" / self.node_id

    @property
    def status_file(self) -> Path:
        return self.node_dir / "status.json"

    def generation_dir(self, generation: int) -> Path:
        return self.node_dir / f"g{generation}"

    def socket_path(self, name: str) -> Path:
        """A unix socket path for ``name``, short enough for the kernel's limit: in the node directory, else in
        this agent's private directory under the system temp dir (made on first use, see the module doc)."""
        path = self.node_dir / name
        if len(os.fsencode(path)) <= SOCKET_PATH_LIMIT:
            return path
        return self._socket_dir / name

    @functools.cached_property
    def _socket_dir(self) -> Path:
        made = Path(tempfile.mkdtemp(prefix="resilient-"))
        check_private_dir(made)
        return made

    def remove_socket_dir(self) -> None:
        """Remove the private socket directory this RunDir made, if it made one (at the agent's end)."""
        made = self.__dict__.get("_socket_dir")
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)

    def create(self) -> str:
        """Create the directories (private to the user) and the token; return the token."""
        for d in (self.root, self.incidents, self.node_dir):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        return ensure_token(self.token_file)


def check_private_dir(path: Path, what: str = "socket directory",
                      fix: str = "remove it, or set TMPDIR to a directory only you can write") -> None:
    """Refuse a private directory of the run (``what``) that is a symlink, not a directory, not owned by this user,
    or open to others (ConfigError naming the path and ``fix``)."""
    st = os.lstat(path)
    problem = ("is a symbolic link" if stat.S_ISLNK(st.st_mode) else "is not a directory" if not stat.S_ISDIR(st.st_mode)
               else f"belongs to uid {st.st_uid}, not to this user ({os.geteuid()})" if st.st_uid != os.geteuid()
               else f"has mode {stat.S_IMODE(st.st_mode):o}, open to other users" if st.st_mode & 0o077 else None)
    if problem is not None:
        raise ConfigError(f"the {what} {path} {problem}: another user may have made it to capture what the run "
                          f"keeps there; {fix}")


def heartbeat_socket(run_dir: RunDir, local_rank: int) -> str:
    """The heartbeat socket of one local rank (one each: a shared datagram queue overflowed)."""
    return str(run_dir.socket_path(f"hb{local_rank}.sock"))


def ensure_token(path: Path) -> str:
    """Return the run's token, creating it (mode 0600) if it does not exist yet.

    Agents started together on one run directory race to create it: the
    token is written and fsynced under a private temporary name first and
    then linked into place (``link`` fails if the name exists), so the name
    never shows a partly written token, and every agent reads the winner's.
    """
    if path.exists():
        return read_token(path)
    token = secrets.token_hex(32)
    fd, tmp = tempfile.mkstemp(prefix=".token.", dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return read_token(path)
    finally:
        os.unlink(tmp)
    return token


def read_token(path: Path) -> str:
    """Read the token, refusing one that other users can read."""
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise ConfigError(f"run token {path} has mode {mode:o}; other users can read it. Run: chmod 600 {path}")
    token = path.read_text().strip()
    if len(token) < 32:
        raise ConfigError(f"run token {path} is empty or truncated; delete it and restart the agent to make a new one")
    return token
