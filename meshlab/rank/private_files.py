"""Files of one user's session that no other local user can read, replace or redirect.

The temp directory is shared with every user of the machine, so a folder there must not
have a name another user can guess and create first (with a symlink inside pointing at a
file of ours), nor be readable by them: each session's folder is made atomically by
``mkdtemp`` (0700, a random name), and its files are created new, 0600, without following
links. The folder's name carries the pid of the process that made it (the notebook for cut
output, rank 0 for the rendezvous store), so folders left by processes that died are found
and removed by the next session of the same user. Plain Python: ranks use it too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import IO

PREFIX = "meshlab-output-"  # a notebook's cut output
STORE_PREFIX = "meshlab-store-"  # rank 0's rendezvous store
PREFIXES = (PREFIX, STORE_PREFIX)


def private_dir(parent: str | Path | None = None, prefix: str = PREFIX) -> Path:
    """A new folder only this user can enter (0700, a name no one can guess), in
    ``parent`` or the temp directory; first, this user's folders of dead processes go."""
    if prefix not in PREFIXES:
        raise ValueError(f"prefix {prefix!r} is not one of {PREFIXES}: sweep() would never "
                         "find its folders")
    parent = Path(parent or tempfile.gettempdir())
    sweep(parent)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent))


def subfolder(folder: Path, name: str) -> Path:
    """``folder/name``, made 0700 (inside a private folder no one else can have made it)."""
    path = folder / name
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    return path


def open_private(path: Path) -> IO[str]:
    """``path`` created new for writing, 0600, refusing a link or a file already there."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.fdopen(os.open(path, flags, 0o600), "w")


def output_folder(path: str | Path, option: str) -> Path:
    """The folder a user named for output (``option`` names where: ``--profile-dir``), made
    0700 if missing and checked writable before any work is done, so a failure to write
    loses nothing: ValueError naming the option, the path and the reason."""
    folder = Path(path).expanduser()
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{option} {str(path)!r}: cannot make the folder ({e.strerror}): "
                         "name a folder you can write") from None
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        why = "not a folder" if not folder.is_dir() else "not writable by you"
        raise ValueError(f"{option} {str(path)!r} is {why}: name a folder you can write; "
                         "nothing ran")
    return folder


def check_target(path: Path) -> None:
    """Refuse to write ``path`` where another local user could redirect or read it: a link,
    a folder, or a folder of another user's (ValueError naming it). Check every file of a
    set first, so a refusal leaves nothing half written."""
    folder = path.parent
    if folder.exists() and folder.stat().st_uid != os.getuid():
        raise ValueError(f"{folder} belongs to another user (uid {folder.stat().st_uid}): they "
                         f"could read or replace {path.name}; write into a folder of your own")
    if path.is_symlink():
        raise ValueError(f"{path} is a link (to {os.readlink(path)}): meshlab does not write "
                         "through links; remove it, or write elsewhere")
    if path.is_dir():
        raise ValueError(f"{path} is a folder: remove it, or write elsewhere")


def write_private(path: Path, text: str, mode: int = 0o600) -> None:
    """``path`` (checked by ``check_target``) written whole or not at all: a new file (0600,
    or ``mode``) beside it, renamed over it, so a link planted meanwhile is replaced, never
    followed."""
    check_target(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w") as out:
            out.write(text)
            os.fchmod(out.fileno(), mode)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def sweep(parent: Path) -> None:
    """Remove this user's session folders whose process is gone (another user's: never)."""
    for prefix in PREFIXES:
        for folder in parent.glob(f"{prefix}*-*"):
            _sweep_one(folder, folder.name[len(prefix):].split("-", 1)[0])


def private_profile(profile_dir: str | Path) -> None:
    """ipyparallel's profile folder for meshlab, made or made again 0700 with its ``log``
    and ``security`` folders: the logs hold what the ranks wrote to their file descriptors,
    the connection files the controller's key. Logs of notebooks that died go."""
    profile = Path(profile_dir)
    for folder in (profile, profile / "log", profile / "security"):
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if folder.is_symlink() or folder.stat().st_uid != os.getuid():
            raise ValueError(f"{folder} is {'a link' if folder.is_symlink() else 'not yours'}"
                             ": meshlab keeps its logs and keys only in a folder of your own;"
                             " remove it, or set IPYTHONDIR to a folder of yours")
        os.chmod(folder, 0o700)
    sweep_logs(profile / "log")


def sweep_logs(log: Path) -> None:
    """Remove the logs of clusters whose notebook is gone: the controller's log is named
    ``ipcontroller-<cluster id>-<pid of the notebook>.log``, and every file of that cluster
    (its engines' logs, their exits, its record of engines) holds its id."""
    for controller in log.glob("ipcontroller-*-*.log"):
        cluster_id, _, pid = controller.stem[len("ipcontroller-"):].rpartition("-")
        if cluster_id and pid.isdigit() and not _alive(int(pid)):
            for path in log.glob(f"*{cluster_id}*"):
                with contextlib.suppress(OSError):
                    path.unlink()


def _sweep_one(folder: Path, pid: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        info = folder.lstat()
        if (folder.is_symlink() or info.st_uid != os.getuid() or not pid.isdigit()
                or _alive(int(pid))):
            return
        shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process has that pid now: keep the folder
        return True
    return True
