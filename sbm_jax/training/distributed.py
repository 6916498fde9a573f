"""Multi-process start-up.

One JAX process runs per host (TPU VM worker, GPU node, Slurm task). Before any other
JAX call, every process calls ``maybe_initialize_distributed``; it connects them through
``jax.distributed.initialize`` when there is more than one, and does nothing otherwise.
Where the values come from, first match wins:

1. explicit arguments (the ``--coordinator_address``, ``--num_processes``,
   ``--process_id`` flags of a launcher);
2. the environment: ``SBM_COORDINATOR`` (``host:port``), ``SBM_NUM_PROCESSES``,
   ``SBM_PROCESS_ID``;
3. a detected cluster: a multi-host Cloud TPU slice (``TPU_WORKER_HOSTNAMES`` lists more
   than one host) or a Slurm job step with ``SLURM_NTASKS`` > 1. JAX then finds the
   coordinator itself, so ``jax.distributed.initialize()`` is called with no arguments;
4. otherwise a single process: nothing to do.

After start-up the trainer feeds each process only its rows of every global batch
(``sbm_jax.training.host_data``); process 0 writes the run's files.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax

ENV_COORDINATOR = "SBM_COORDINATOR"
ENV_NUM_PROCESSES = "SBM_NUM_PROCESSES"
ENV_PROCESS_ID = "SBM_PROCESS_ID"


class DistributedConfigError(ValueError):
    """Inconsistent multi-process settings; the message names the flag or variable."""


@dataclasses.dataclass(frozen=True)
class DistributedSetup:
    """What ``maybe_initialize_distributed`` decided.

    Attributes:
      mode: ``"single"`` (nothing done), ``"explicit"`` (flags and/or SBM_* variables),
        ``"tpu"`` or ``"slurm"`` (cluster auto-detection), ``"already"`` (JAX's
        distributed runtime was already up).
      coordinator_address: ``host:port`` passed to JAX, or None when JAX finds it.
      num_processes: processes in the job (None when JAX finds it).
      process_id: this process's index (None when JAX finds it).
    """

    mode: str
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    @property
    def initialized(self) -> bool:
        """True when ``jax.distributed.initialize`` was called (or had been)."""
        return self.mode != "single"


def _parse_int(value: Any, name: str) -> int:
    try:
        number = int(str(value).strip())
    except ValueError:
        raise DistributedConfigError(f"{name} must be an integer, got {value!r}") from None
    return number


def _from_flag_or_env(
    value: Any, flag: str, env: Mapping[str, str], var: str
) -> tuple[Any, str] | tuple[None, None]:
    """(value, name of its source) from the explicit flag, else the environment."""
    if value is not None and value != "":
        return value, f"--{flag}"
    if env.get(var, "").strip():
        return env[var].strip(), var
    return None, None


def _detect_cluster(env: Mapping[str, str]) -> str | None:
    """ "tpu" or "slurm" when the environment is a multi-process job JAX can find itself."""
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if len(hosts) > 1:
        return "tpu"
    ntasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or ""
    if env.get("SLURM_JOB_ID") or ntasks:
        try:
            if int(ntasks) > 1:
                return "slurm"
        except ValueError:
            raise DistributedConfigError(
                f"SLURM_NTASKS must be an integer, got {ntasks!r}"
            ) from None
    return None


def resolve_distributed_setup(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    env: Mapping[str, str] | None = None,
) -> DistributedSetup:
    """Decide how to start (see the module docstring), without calling JAX.

    Raises:
      DistributedConfigError: values that cannot describe a job (process_id >=
        num_processes, a coordinator without a process count, a missing port ...); the
        message names the flag or variable each value came from.
    """
    env = os.environ if env is None else env
    coord, coord_src = _from_flag_or_env(
        coordinator_address, "coordinator_address", env, ENV_COORDINATOR
    )
    nproc, nproc_src = _from_flag_or_env(num_processes, "num_processes", env, ENV_NUM_PROCESSES)
    pid, pid_src = _from_flag_or_env(process_id, "process_id", env, ENV_PROCESS_ID)

    if coord is None and nproc is None and pid is None:
        cluster = _detect_cluster(env)
        return DistributedSetup(mode=cluster or "single")

    if nproc is not None:
        nproc = _parse_int(nproc, nproc_src)  # type: ignore[arg-type]
        if nproc < 1:
            raise DistributedConfigError(f"{nproc_src} must be >= 1, got {nproc}")
    if pid is not None:
        pid = _parse_int(pid, pid_src)  # type: ignore[arg-type]
        if pid < 0:
            raise DistributedConfigError(f"{pid_src} must be >= 0, got {pid}")

    if nproc == 1:  # one process, whatever the coordinator: nothing to connect
        if pid not in (None, 0):
            raise DistributedConfigError(
                f"{pid_src}={pid} is out of range for {nproc_src}=1 (process ids are 0..0)"
            )
        return DistributedSetup(mode="single", num_processes=1, process_id=0)

    missing = [
        f"{flag} (or ${var})"
        for flag, value, var in (
            ("--coordinator_address", coord, ENV_COORDINATOR),
            ("--num_processes", nproc, ENV_NUM_PROCESSES),
            ("--process_id", pid, ENV_PROCESS_ID),
        )
        if value is None
    ]
    if missing:
        given = ", ".join(s for s in (coord_src, nproc_src, pid_src) if s)
        raise DistributedConfigError(
            f"multi-process start-up needs all three of coordinator address, process count "
            f"and process id; {given} given but missing {', '.join(missing)}"
        )
    coord = str(coord)
    host, sep, port = coord.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedConfigError(
            f"{coord_src} must be host:port (e.g. 10.0.0.2:8476), got {coord!r}"
        )
    if pid >= nproc:  # type: ignore[operator]
        raise DistributedConfigError(
            f"{pid_src}={pid} is out of range for {nproc_src}={nproc} "
            f"(process ids are 0..{nproc - 1})"  # type: ignore[operator]
        )
    return DistributedSetup(
        mode="explicit", coordinator_address=coord, num_processes=nproc, process_id=pid
    )


def maybe_initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> DistributedSetup:
    """Connect this process to the others, if there are others; call before any JAX work.

    Args:
      coordinator_address: ``host:port`` of process 0's coordinator service
        (default ``$SBM_COORDINATOR``).
      num_processes: processes in the job (default ``$SBM_NUM_PROCESSES``).
      process_id: this process's index in ``0..num_processes - 1``
        (default ``$SBM_PROCESS_ID``).

    Returns:
      The ``DistributedSetup`` used. With none of the three given anywhere and no
      multi-host TPU or Slurm environment, nothing is called (``mode == "single"``).

    Raises:
      DistributedConfigError: inconsistent values, naming the flag or variable.
    """
    if jax.distributed.is_initialized():
        return DistributedSetup(
            mode="already", num_processes=jax.process_count(), process_id=jax.process_index()
        )
    setup = resolve_distributed_setup(coordinator_address, num_processes, process_id)
    if setup.mode == "explicit":
        jax.distributed.initialize(
            coordinator_address=setup.coordinator_address,
            num_processes=setup.num_processes,
            process_id=setup.process_id,
        )
    elif setup.mode in ("tpu", "slurm"):
        try:
            jax.distributed.initialize()
        except (ValueError, RuntimeError) as err:
            found = (
                "a Slurm job (SLURM_JOB_ID, SLURM_NTASKS > 1)"
                if setup.mode == "slurm"
                else "a multi-host TPU slice (TPU_WORKER_HOSTNAMES)"
            )
            first = (str(err).strip().splitlines() or [""])[0][:200]
            raise DistributedConfigError(
                f"{found} was detected, but JAX could not connect its processes "
                f"({type(err).__name__}: {first}); launch one process per task (srun), "
                f"give --coordinator_address/--num_processes/--process_id, or set "
                f"{ENV_NUM_PROCESSES}=1 to run a single process"
            ) from None
    return setup
