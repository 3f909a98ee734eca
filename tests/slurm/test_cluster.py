"""The test cluster works the way the trainer uses it: a submitit job with several tasks sees its
ranks and forms a gloo group; cancelled, failing and impossible jobs end with a clear answer, never
a hang. Needs a cluster (.ci/slurm/up.sh); skips without one."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import pytest
import submitit
from submitit.core.utils import FailedJobError, UncompletedJobError

import slurm_jobs

HERE = Path(__file__).resolve().parent
WAIT_S = 120  # longest any job here may take, queueing included


def make_executor(folder: Path, partition: str, **params) -> submitit.AutoExecutor:
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
    executor.update_parameters(
        # submitit asks SLURM for SIGUSR2 90 s before the time limit; a short limit would
        # signal a job still importing torch from a cold disk (seen in fresh clones).
        slurm_partition=partition, nodes=1, tasks_per_node=1, cpus_per_task=1, timeout_min=10,
        # The job unpickles slurm_jobs.<function> by reference: its Python must import slurm_jobs.
        slurm_setup=[f"export PYTHONPATH={HERE}${{PYTHONPATH:+:$PYTHONPATH}}"],
    )
    executor.update_parameters(**params)
    return executor


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.5)


def wait_done(job: submitit.Job, timeout_s: float = WAIT_S) -> None:
    """Waits until submitit sees the job finished (result file or SLURM state). Unlike
    job.wait(), gives up: cancels the job and fails with its state and log paths."""
    deadline = time.monotonic() + timeout_s
    while not job.done(force_check=True):
        if time.monotonic() > deadline:
            job.cancel(check=False)
            pytest.fail(f"job {job.job_id} not done after {timeout_s} s (state {job.state}); "
                        f"logs: {job.paths.stdout} {job.paths.stderr}")
        time.sleep(0.5)


def test_two_task_job_sees_its_ranks_and_forms_a_gloo_group(slurm_client, slurm_partition,
                                                             tmp_path):
    executor = make_executor(tmp_path, slurm_partition, tasks_per_node=2)
    job = executor.submit(slurm_jobs.report_ranks)
    wait_done(job)

    results = job.results()  # one per task, in task order

    assert len(results) == 2, results
    for rank, result in enumerate(results):
        assert result["global_rank"] == result["dist_rank"] == rank, result
        assert result["local_rank"] == rank, result
        assert result["num_tasks"] == result["world_size"] == 2, result
        assert result["SLURM_PROCID"] == str(rank), result
        assert result["SLURM_NTASKS"] == "2", result
        assert result["all_reduce_sum"] == 3.0, result  # (0 + 1) + (1 + 1)
    assert results[0]["master"] == results[1]["master"], results


def test_cancelled_job_is_reported_cancelled_not_waited_on(slurm_client, slurm_partition, tmp_path):
    marker = tmp_path / "started"
    executor = make_executor(tmp_path, slurm_partition)
    job = executor.submit(slurm_jobs.mark_and_sleep, str(marker), 600)
    wait_until(marker.exists, WAIT_S, f"job {job.job_id} to start")

    job.cancel()
    wait_done(job, timeout_s=60)  # done only if the SLURM state (via sacct) says it ended

    assert job.state.startswith("CANCELLED"), job.state
    started = time.monotonic()
    with pytest.raises(UncompletedJobError, match="CANCELLED"):
        job.result()  # no result file: submitit waits up to 15 s for one, then raises
    assert time.monotonic() - started < 30


def test_failing_job_reports_the_exception(slurm_client, slurm_partition, tmp_path):
    job = make_executor(tmp_path, slurm_partition).submit(slurm_jobs.fail, "boom from the job")
    wait_done(job)

    with pytest.raises(FailedJobError, match="ValueError: boom from the job"):
        job.result()


def test_job_array_runs_each_item_and_reports_its_state(slurm_client, slurm_partition, tmp_path):
    # hydra/launcher=submitit_slurm submits a sweep as one job array: ids "<array>_<index>".
    jobs = make_executor(tmp_path, slurm_partition).map_array(slurm_jobs.square, [2, 3])
    for job in jobs:
        wait_done(job)

    assert [job.result() for job in jobs] == [4, 9]
    assert [job.job_id.split("_")[1] for job in jobs] == ["0", "1"]
    for job in jobs:  # the state comes from sacct, which must know array items by their ids
        wait_until(lambda job=job: job.get_info(mode="force").get("State") == "COMPLETED", 30,
                   f"job {job.job_id} to be COMPLETED in sacct")


def test_impossible_request_is_rejected_at_submit(slurm_client, slurm_partition, tmp_path):
    # EnforcePartLimits=ALL: sbatch refuses at once instead of leaving the job pending forever.
    executor = make_executor(tmp_path, slurm_partition, cpus_per_task=10_000)
    with pytest.raises(FailedJobError, match="More processors requested than permitted"):
        executor.submit(slurm_jobs.fail, "never runs")
