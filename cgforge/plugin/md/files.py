"""Files of an MD run: output names that never overwrite inputs, reserved when chosen so that concurrent runs
never share one, structures and restarts read with one clear error (a trajectory with a cut-off end from its last
whole frame), trajectories written crash-safely, the log's line printers."""

from __future__ import annotations

import datetime
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
from ase import Atoms

from .options import PLOT_SUFFIXES, read_saved  # noqa: F401 (PLOT_SUFFIXES: run.py's)

XYZ_SUFFIXES = (".xyz", ".extxyz")
TRAJ_SUFFIXES = (".traj", *XYZ_SUFFIXES)

@dataclass
class Restart:
    """The state a restart continues from: the last frame of a trajectory written by :func:`run_md`."""

    path: Path
    atoms: Atoms
    step: int
    time_fs: float
    etot0: float | None
    rng_state: dict | None  # ASE's dynamics: the numpy generator's state (md_rng)
    engine_state: dict | None = None  # the device engine: seed, integrator, its scalars (md_engine)
    options: dict[str, Any] = field(default_factory=dict)  # the run's saved options (md_ensemble, ...)
    epot: float | None = None  # the frame's potential energy: a restart on another model is refused
    model: str | None = None  # the model that ran it (md_model), for the messages
    note: str | None = None  # what was skipped to find the frame (a damaged end), said when the run starts


def check_new_path(path: str | os.PathLike, force: bool = False, what: str = "trajectory",
                   suffixes: tuple[str, ...] | None = TRAJ_SUFFIXES) -> Path:
    """``path`` as a Path, after refusing an existing file (unless ``force``), a directory, a missing parent
    or (when ``suffixes`` is given) a name that does not end with one of them."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"{what}: expected a file name, got {type(path).__name__}")
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{what}: {path} is a directory, expected a file name")
    if suffixes is not None and path.suffix.lower() not in suffixes:
        raise ValueError(f"{what}: {path} must end with {', '.join(suffixes[:-1])} or {suffixes[-1]}")
    if path.exists() and not force:
        raise FileExistsError(f"{what}: {path} exists; choose a new name or pass --force (force=True) to overwrite")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{what}: directory {path.parent} does not exist")
    check_writable(path, what)
    return path


def check_writable(path: Path, what: str) -> None:
    """Refuse, naming ``what`` and ``path``, a file that could not be written: a probe file created and removed in
    its folder answers for permissions, read-only file systems and root alike; an existing file must be writable."""
    probe = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.probe")
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        os.unlink(probe)
        if path.exists() and not os.access(path, os.W_OK):
            raise PermissionError(13, "the file is read-only")
    except OSError as err:
        raise PermissionError(f"{what}: cannot write {path}: {err.strerror or err}") from None


def _same_file(a: Path, b: Path) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)  # hard links
    except OSError:
        return False


def check_distinct(outputs: dict[str, Path | None], inputs: dict[str, Path | None]) -> None:
    """Refuse an output that names an input file or another output (``force`` never overrides this)."""
    outs = [(k, v) for k, v in outputs.items() if v is not None]
    for i, (name, path) in enumerate(outs):
        for in_name, in_path in inputs.items():
            if in_path is not None and _same_file(path, in_path):
                raise ValueError(f"{name}: {path} is the {in_name} file; cgforge never writes over its input")
        for other, other_path in outs[i + 1:]:
            if _same_file(path, other_path):
                raise ValueError(f"{name} and {other} name the same file ({path}); give them different names")


class FreeName(os.PathLike):
    """A default output name: ``<base>.traj``, else ``<base>-1.traj``, ``<base>-2.traj``... whichever
    :meth:`Reservations.take` can create first (``str()`` is the first one free when it was made)."""

    def __init__(self, base: Path, suffix: str = ".traj") -> None:
        self.base, self.suffix = base, suffix
        self.first = next(n for n in range(1_000_000) if not self.candidate(n).exists())

    def candidate(self, n: int) -> Path:
        return self.base.with_name(f"{self.base.name}{f'-{n}' if n else ''}{self.suffix}")

    def __fspath__(self) -> str:
        return str(self.candidate(self.first))

    __str__ = __fspath__


def default_trajectory_path(stem: str = "md", directory: str | os.PathLike = ".") -> FreeName:
    """A file name that does not exist yet: ``<stem>-<date>-<time>.traj`` (with -1, -2... if needed); a run
    reserves the first of these still free when its outputs are created (two runs never share one)."""
    return FreeName(Path(directory) / f"{stem}-{datetime.datetime.now():%Y%m%d-%H%M%S}")


class Reservations:
    """A run's output names, created as empty files when chosen (``O_CREAT | O_EXCL``: two runs never share one;
    under ``force`` an existing one is remembered as it was); :meth:`check_mine`, :meth:`release`."""

    def __init__(self) -> None:
        self._files: dict[Path, tuple[bool, tuple]] = {}  # path -> (created by us, its identity then)

    def take(self, path: Path | FreeName, force: bool, what: str) -> Path:
        """Create ``path`` (a :class:`FreeName`: its first free candidate) for this run; the name to write."""
        free = isinstance(path, FreeName)
        n = path.first if free else 0
        while True:
            name = path.candidate(n) if free else Path(path)
            try:
                os.close(os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # umask decides the mode
            except FileExistsError:
                if free:
                    n += 1
                    continue
                if not force:
                    raise FileExistsError(f"{what}: {name} exists (another run took the name?); choose a new name "
                                          "or pass --force (force=True) to overwrite it") from None
                self._files[name] = (False, _identity(name))
                return name
            except OSError as err:
                raise PermissionError(f"{what}: cannot write {name}: {err.strerror or err}") from None
            self._files[name] = (True, _identity(name))
            return name

    def check_mine(self, path: Path, what: str) -> None:
        """Refuse to put a file in place at ``path`` when it is no longer the file this run reserved (or, under
        ``force``, the file it found): another run or program wrote it since."""
        entry = self._files.get(path)
        if entry is not None and _identity(path) != entry[1]:
            raise FileExistsError(f"{what}: {path} was replaced by another program after this run reserved the "
                                  "name; it is left as it is and this run's frames are not written there")

    def release(self) -> None:
        """Remove the files this run created that are still empty and its own (no frame or plot replaced them)."""
        for path, (created, identity) in list(self._files.items()):
            if created and _identity(path) == identity:
                path.unlink()
            del self._files[path]


def _identity(path: Path) -> tuple:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return ()
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def read_structure(path: str | os.PathLike, what: str = "structure", index: int | str = -1) -> Atoms:
    """The structure in ``path`` (any ase.io format; the last frame of a trajectory), or one clear error
    naming ``what`` and the file: missing, a directory, empty, not a structure, no atoms."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"{what}: expected a file name, got {type(path).__name__}")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what}: {path} not found")
    if path.is_dir():
        raise IsADirectoryError(f"{what}: {path} is a directory, expected a structure file")
    if path.stat().st_size == 0:
        raise ValueError(f"{what}: {path} is empty")
    from ase.io import read

    try:
        atoms = read(path, index=index)
    except Exception as err:  # ase.io raises a different type per format; all mean "not a structure"
        whole = last_whole_frame(path) if index == -1 else None
        if whole is not None:  # a trajectory whose end was cut off: say which frame is whole
            raise ValueError(f"{what}: {path}: its last frame is cut off (a killed run or a full disk); frame "
                             f"{whole[1] + 1} of {whole[2]} is the last whole one, which a restart (--restart, "
                             "restart=) continues from") from None
        reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise ValueError(f"{what}: {path}: not a structure file ase.io can read (e.g. .xyz, .extxyz, .traj, "
                         f"POSCAR, .cif): {type(err).__name__}: {reason}") from None
    if isinstance(atoms, list):
        atoms = atoms[-1] if atoms else None
    if not isinstance(atoms, Atoms) or len(atoms) == 0:
        raise ValueError(f"{what}: {path} holds no atoms")
    return atoms


def encode_info(state: dict) -> str:
    """A frame's ``atoms.info`` value for ``state``: hex of JSON, only [0-9a-f], so it survives extended XYZ's
    key=value comment line as well as .traj."""
    return json.dumps(state).encode().hex()


def _decode_info(text: Any, key: str, needs: str, what: str, path: Path) -> dict:
    try:
        state = json.loads(bytes.fromhex(str(text)).decode())
        if not isinstance(state, dict) or needs not in state:
            raise ValueError(f"no {needs!r} in it")
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{what}: {path}: the saved random state {key} is unreadable ({err})") from None
    return state


def read_restart(path: str | os.PathLike | Restart, what: str = "restart") -> Restart:
    """The last frame of a trajectory written by :func:`run_md`, with the step counter and random state."""
    if isinstance(path, Restart):
        return path
    note = None
    try:
        if Path(path).suffix.lower() in XYZ_SUFFIXES and not _ends_with_newline(Path(path)):
            raise ValueError("cut off")  # its last line may be cut within a number, which ase.io would read
        atoms = read_structure(path, what)
    except ValueError:
        whole = last_whole_frame(Path(path))
        if whole is None:
            atoms = read_structure(path, what)  # its error, or a file that reads after all
        else:
            atoms, index, frames, ignored = whole
            lost = frames - index - 1
            note = (f"{what}: {path}: its last {f'{lost} frames are' if lost > 1 else 'frame is'} cut off (the run "
                    f"was killed while writing, or the disk filled): continuing from frame {index + 1} of {frames} "
                    f"(step {atoms.info.get('md_step', '?')}), the last whole one; the {ignored} bytes after it are "
                    "ignored and the file is left as it is")
    path = Path(path)
    info = atoms.info
    if "md_step" not in info:
        raise ValueError(f"{what}: {path} has no MD step counter (md_step in the frame's info): it was not written "
                         "by cgforge md / run_md; start from it as a structure instead")
    try:
        step = int(info["md_step"])
    except (TypeError, ValueError):
        raise ValueError(f"{what}: {path}: md_step is {info['md_step']!r}, expected an int") from None
    if step < 0:
        raise ValueError(f"{what}: {path}: md_step is {step}, expected >= 0")
    if not atoms.has("momenta"):
        raise ValueError(f"{what}: {path}: the last frame has no momenta to continue from")
    rng = _decode_info(info["md_rng"], "md_rng", "bit_generator", what, path) if "md_rng" in info else None
    ours = type(np.random.default_rng(0).bit_generator).__name__
    if rng is not None and rng["bit_generator"] != ours:
        raise ValueError(f"{what}: {path}: the saved random state is for {rng['bit_generator']}; run_md uses {ours}")
    engine = _decode_info(info["md_engine"], "md_engine", "seed", what, path) if "md_engine" in info else None
    etot0 = float(info["md_etot0"]) if "md_etot0" in info else None
    time_fs = float(info.get("md_time_fs", float("nan")))
    options = read_saved(info)
    results = getattr(atoms.calc, "results", None) or {}
    epot = info.get("md_epot", results.get("energy"))
    model = str(info["md_model"]) if "md_model" in info else None
    for key in [k for k in info if k.startswith("md_")]:
        info.pop(key)
    atoms.calc = None  # the frame's stored results are not the calculator's
    return Restart(path=path, atoms=atoms, step=step, time_fs=time_fs, etot0=etot0, rng_state=rng,
                   engine_state=engine, options=options, epot=None if epot is None else float(epot), model=model,
                   note=note)


def _ends_with_newline(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"
    except OSError:
        return True  # empty or unreadable: read_structure says which


def last_whole_frame(path: Path) -> tuple[Atoms, int, int, int] | None:
    """The last whole frame of a .traj or extended-XYZ trajectory whose end was cut off: ``(frame, its index,
    the frames the file holds or began, the bytes after that frame)``, or None. The file is only read."""
    suffix = path.suffix.lower()
    find = _last_whole_traj_frame if suffix == ".traj" else _last_whole_xyz_frame if suffix in XYZ_SUFFIXES else None
    try:
        return None if find is None else find(path)
    except (OSError, ValueError):
        return None


def _last_whole_traj_frame(path: Path) -> tuple[Atoms, int, int, int] | None:
    from ase.io.trajectory import Trajectory
    from ase.io.ulm import read_header

    size = path.stat().st_size
    with open(path, "rb") as fd:
        offsets = read_header(fd)[4]  # where each frame's description starts; the header counts the frames
        ends = []
        for offset in offsets:  # a frame's arrays precede its description: a whole description, a whole frame
            fd.seek(int(offset))
            head = fd.read(8)
            ends.append(int(offset) + 8 + int.from_bytes(head, "little") if len(head) == 8 else size + 1)
    with Trajectory(str(path)) as traj:
        for index in reversed(range(len(offsets))):
            if ends[index] > size:
                continue
            try:
                return traj[index], index, len(offsets), size - ends[index]
            except Exception:  # noqa: BLE001 (ase.io raises per format: any error is a damaged frame)
                continue
    return None


def _last_whole_xyz_frame(path: Path) -> tuple[Atoms, int, int, int] | None:
    from io import StringIO

    from ase.io import read

    whole, frames = None, 0
    with open(path, "rb") as f:
        while True:
            start = f.tell()
            line = f.readline()
            if not line.strip():
                if not line:
                    break
                continue
            frames += 1
            n = int(line) if line.endswith(b"\n") and line.strip().isdigit() else -1
            body = [f.readline() for _ in range(n + 1)] if n >= 0 else []
            if n < 0 or not all(b.endswith(b"\n") for b in body):
                break  # the cut: this frame and anything after it
            whole = (start, f.tell(), frames - 1)
        size = f.seek(0, os.SEEK_END)
        if whole is None:
            return None
        start, end, index = whole
        f.seek(start)
        text = f.read(end - start).decode()
    return read(StringIO(text), format="extxyz", index=-1), index, frames, size - end


def check_same_system(atoms: Atoms | None, restart: Restart) -> None:
    frame = restart.atoms
    if atoms is not None and (len(atoms) != len(frame) or not np.array_equal(atoms.numbers, frame.numbers)):
        raise ValueError(f"restart: {restart.path} holds {frame.get_chemical_formula()} ({len(frame)} atoms), "
                         f"atoms is {atoms.get_chemical_formula()} ({len(atoms)} atoms); pass atoms=None to "
                         "continue the saved structure")


# A restart whose calculator gives the restart frame another potential energy than the saved one, by more than this,
# runs another model: precision moves it far less (< 1e-4 meV/atom, float64 to float32), two models by meV/atom.
MODEL_MISMATCH_MEV_PER_ATOM = 0.5


def model_name(model: str | None, calc: Any) -> str:
    """How frames name the model that ran them (``md_model``): the name the user gave and the model's family, or
    the calculator's class."""
    kind = getattr(getattr(calc, "adapter", None), "kind", None) or type(calc).__name__
    return f"{model} ({kind})" if model and model.lower() != kind else str(kind)


def check_restart_model(restart: Restart, atoms: Atoms, model: str, what: str, new_run: str) -> None:
    """A restart's calculator must give the restart frame (``atoms``, its forces computed) the saved potential
    energy: the same model. ``what`` names the restart, ``new_run`` how to start a new run from the frame."""
    if restart.epot is None:
        return
    epot = float(atoms.get_potential_energy())
    apart = abs(epot - restart.epot) / len(atoms) * 1000.0
    if not apart <= MODEL_MISMATCH_MEV_PER_ATOM:
        raise ValueError(f"{what}: {restart.path} was run with {restart.model or 'another model'}, whose energy of "
                         f"step {restart.step} is {restart.epot:.6f} eV; this model ({model}) gives {epot:.6f} eV, "
                         f"{apart:.3g} meV/atom apart: a restart continues the same model (the energy drift is "
                         f"measured from its energy). Start a new run from the last frame instead ({new_run})")


def continue_from(atoms: Atoms | None, restart: Restart) -> Atoms:
    """``atoms`` set to the restart frame's state (positions, momenta, cell), or the frame's Atoms if None."""
    if atoms is None or atoms is restart.atoms:
        return restart.atoms
    frame = restart.atoms
    atoms.set_cell(frame.cell)
    atoms.pbc = frame.pbc
    atoms.positions = frame.positions
    atoms.set_momenta(frame.get_momenta())
    return atoms


class TrajectoryWriter:
    """Frames to ``path``: the first goes to a hidden temporary file that then replaces ``path`` (if no other
    program wrote it since ``reserved`` took it), so a run that fails before its first frame leaves it untouched."""

    def __init__(self, path: Path, atoms: Atoms, what: str = "trajectory",
                 reserved: Reservations | None = None) -> None:
        self.path, self.atoms, self.what, self.reserved = path, atoms, what, reserved
        self.frames = 0
        self.last_step: int | None = None
        self._traj = None
        self._xyz = path.suffix.lower() in XYZ_SUFFIXES
        self._tmp: Path | None = None

    def write(self, step: int, info: dict[str, Any]) -> None:
        self.atoms.info.update(info)
        try:
            if self.frames == 0:
                self._first_frame()
            elif self._xyz:
                self._write_xyz(self.path)
            else:
                self._traj.write()
        except FileExistsError:  # Reservations.check_mine: its message names the file and what happened
            raise
        except OSError as err:  # the disk filled, the folder went away: name the file the user gave
            raise OSError(f"{self.what}: cannot write {self.path}: {err.strerror or err}") from None
        finally:
            for key in info:
                self.atoms.info.pop(key, None)
        self.frames += 1
        self.last_step = step

    def _write_xyz(self, path: Path) -> None:
        from ase.io import write

        write(str(path), self.atoms, format="extxyz", append=True)

    def _first_frame(self) -> None:
        from ase.io.trajectory import Trajectory

        self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
        os.close(os.open(self._tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # umask decides the mode
        if self._xyz:
            self._write_xyz(self._tmp)
        else:
            with Trajectory(str(self._tmp), "w", self.atoms) as traj:
                traj.write()
        if self.reserved is not None:
            self.reserved.check_mine(self.path, self.what)  # never over a file another run wrote since
        os.replace(self._tmp, self.path)
        self._tmp = None
        if not self._xyz:
            self._traj = Trajectory(str(self.path), "a", self.atoms)

    def close(self) -> None:
        if self._traj is not None:
            self._traj.close()
            self._traj = None
        if self._tmp is not None and self._tmp.exists():
            self._tmp.unlink()  # our own half-written first frame, never a user's file


@dataclass
class Printer:
    """Where a run's lines go: ``write`` (all of them), ``to_file`` (only the log file, if any), ``close``, ``path``."""

    write: Callable[[str], None]
    close: Callable[[], None]
    path: Path | None = None
    to_file: Callable[[str], None] = lambda line: None


def make_printer(log: Any, force: bool, what: str = "log") -> Printer:
    """The :class:`Printer` of ``log`` (print, a callable, a stream, a file name, a list of these, or None); a
    file name was checked by :func:`check_new_path` and is created here."""
    if log is None:
        return Printer(lambda line: None, lambda: None)
    if log is print:
        return Printer(lambda line: print(line, flush=True), lambda: None)  # the sys.stdout of the moment
    if isinstance(log, str | os.PathLike):
        path = Path(log)
        try:
            stream = open(path, "w" if force else "x", encoding="utf-8")  # noqa: SIM115 (closed by run_md)
        except OSError as err:
            raise OSError(f"{what}: cannot write {path}: {err.strerror or err}") from None
        write = stream_printer(stream)
        return Printer(write, stream.close, path, write)
    if hasattr(log, "write"):
        return Printer(stream_printer(log), lambda: None)
    if callable(log):
        return Printer(log, lambda: None)
    if isinstance(log, list | tuple) and log and not any(isinstance(x, list | tuple) for x in log):
        if sum(isinstance(x, str | os.PathLike) for x in log) > 1:
            raise ValueError(f"{what}: at most one file name in the list")
        parts = [make_printer(x, force, what) for x in log]
        file_part = next((p for p in parts if p.path is not None), None)

        def write_all(line: str) -> None:
            for part in parts:
                part.write(line)

        def close_all() -> None:
            for part in parts:
                part.close()

        return Printer(write_all, close_all, file_part.path if file_part else None,
                       file_part.to_file if file_part else (lambda line: None))
    raise TypeError(f"{what}: expected print, a callable taking a line, a stream, a file name, a list of these or "
                    f"None, got {type(log).__name__}")


def stream_printer(stream: TextIO) -> Callable[[str], None]:
    def write(line: str) -> None:
        stream.write(line + "\n")
        stream.flush()

    return write

