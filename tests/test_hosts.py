"""How a job says it has several processes (common/launch/hosts.py), and what is refused before any process starts
JAX's distributed runtime: a half-set job, Kaggle, and fewer training files than input pipelines. The processes
themselves are tests/test_multihost.py's."""

from common.core.config import load_config
from common.core.errors import ConfigError, DataError
from common.launch.hosts import Job, multiprocess_job

import pytest

CFG = load_config(None, [])
JOB = {
    "KERAS_DISTRIBUTION_JOB_ADDRESSES": "10.0.0.1:1234,10.0.0.2:1234",
    "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
    "KERAS_DISTRIBUTION_PROCESS_ID": "1",
}


def test_a_job_is_one_process_unless_it_says_otherwise():
    assert multiprocess_job(CFG, {}) is None
    assert multiprocess_job(CFG, {**JOB, "KERAS_DISTRIBUTION_NUM_PROCESSES": "1"}) is None
    assert multiprocess_job(CFG, JOB) == Job(2, 1, "10.0.0.1:1234")  # the first address is the coordinator
    pod = load_config(None, ["runtime.multihost=true"])
    assert multiprocess_job(pod, {}) == Job(None, None, None)  # a Cloud TPU pod slice: JAX finds the hosts


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"KERAS_DISTRIBUTION_PROCESS_ID": "2"},
            r"KERAS_DISTRIBUTION_PROCESS_ID=2 is not one of the job's 2 processes",
        ),
        (
            {"KERAS_DISTRIBUTION_PROCESS_ID": ""},
            r"KERAS_DISTRIBUTION_PROCESS_ID='' is not a whole number. Fix: set all",
        ),
        ({"KERAS_DISTRIBUTION_JOB_ADDRESSES": "10.0.0.1"}, r"must name the coordinator \(process 0\) as host:port"),
        ({"KERAS_DISTRIBUTION_NUM_PROCESSES": "0"}, r"a job has at least one process"),
    ],
)
def test_a_half_set_job_is_an_error_that_names_the_variable(change, message):
    with pytest.raises(ConfigError, match=message):
        multiprocess_job(CFG, {**JOB, **change})


def test_kaggle_refuses_a_job_of_several_processes(monkeypatch):
    from common.training.backends.keras_jax.processes import start_hosts

    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Batch")
    for name, value in JOB.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match="Kaggle gives one host"):
        start_hosts(CFG)  # before jax.distributed.initialize: nothing was started


def test_fewer_training_files_than_input_pipelines_is_an_error_that_names_the_fix(demo_records):
    from common.data.pipeline import InputShare, make_train_dataset

    import tensorflow as tf

    records, _ = demo_records
    files = sorted(str(p) for p in records.glob("fold[12]-*.tfrec"))
    share = InputShare(
        64, tf.distribute.InputContext(num_input_pipelines=4, input_pipeline_id=3, num_replicas_in_sync=4)
    )
    with pytest.raises(
        DataError,
        match=r"2 training file\(s\) for 4 input pipelines .* Fix: convert into smaller "
        r"shards \(`tpu2gpu tfrecords --set data.shard_target_mb=...`\)",
    ):
        make_train_dataset(files, CFG.data, share)
