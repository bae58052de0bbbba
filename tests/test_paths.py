import sys
import types

from common.core.errors import DataPathError
from common.core.paths import KAGGLE_ROOT_ENV, kaggle_working_dir, resolve_data_path

import pytest

from builders import says, set_args

SECRET = "ya29.TOKEN-that-must-never-be-seen"


@pytest.fixture
def kaggle(tmp_path, monkeypatch):
    """A simulated /kaggle with inputs in both mount layouts."""
    monkeypatch.setenv(KAGGLE_ROOT_ENV, str(tmp_path))
    for rel in (
        "input/old-style-slug",
        "input/datasets/alice/flowers-tfrec",
        "input/datasets/bob/shared-name",
        "input/datasets/carol/shared-name",
        "input/competitions/digit-comp",
        "input/models/google/efficientnet-v2/tensorflow2/imagenet21k-b0-feature-vector/1",
        "working",
    ):
        (tmp_path / rel).mkdir(parents=True)
    return tmp_path


def test_both_mount_layouts_resolve(kaggle):
    assert resolve_data_path("old-style-slug") == str(kaggle / "input/old-style-slug")
    assert resolve_data_path("owner/old-style-slug") == str(kaggle / "input/old-style-slug")
    assert resolve_data_path("alice/flowers-tfrec") == str(kaggle / "input/datasets/alice/flowers-tfrec")
    assert resolve_data_path("flowers-tfrec") == str(kaggle / "input/datasets/alice/flowers-tfrec")
    assert resolve_data_path("digit-comp") == str(kaggle / "input/competitions/digit-comp")
    handle = "google/efficientnet-v2/tensorflow2/imagenet21k-b0-feature-vector/1"
    assert resolve_data_path(handle) == str(kaggle / "input/models" / handle)
    assert resolve_data_path("bob/shared-name") == str(kaggle / "input/datasets/bob/shared-name")
    assert kaggle_working_dir() == kaggle / "working"


def test_ambiguous_and_missing_names_say_what_is_attached(kaggle):
    with pytest.raises(DataPathError, match="'shared-name' matches several attached inputs.*owner/slug"):
        resolve_data_path("shared-name")
    with pytest.raises(DataPathError) as err:
        resolve_data_path("alice/not-attached")
    message = str(err.value)
    says(message, "'alice/not-attached'", "neither a local path nor an attached Kaggle input")
    assert "datasets/alice/flowers-tfrec" in message and "old-style-slug" in message
    assert "dataset_sources" in message


def test_gcs_and_local_paths_pass_through(kaggle, tmp_path):
    assert resolve_data_path("gs://kds-abc/flowers") == "gs://kds-abc/flowers"
    local = tmp_path / "mine"
    local.mkdir()
    assert resolve_data_path(str(local)) == str(local.resolve())
    with pytest.raises(DataPathError, match="no dataset given"):
        resolve_data_path("")


@pytest.fixture
def kaggle_modules(monkeypatch):
    """Stand-ins for the Kaggle-only kaggle_secrets / kaggle_datasets modules, recording every call."""
    calls = []

    class UserSecretsClient:
        def get_gcloud_credential(self):
            calls.append(("get_gcloud_credential",))
            return SECRET

        def set_tensorflow_credential(self, credential):
            calls.append(("set_tensorflow_credential", credential == SECRET))

    class KaggleDatasets:
        def get_gcs_path(self, name):
            calls.append(("get_gcs_path", name))
            return f"gs://kds-0123/{name}"

    monkeypatch.setitem(sys.modules, "kaggle_secrets", types.SimpleNamespace(UserSecretsClient=UserSecretsClient))
    monkeypatch.setitem(sys.modules, "kaggle_datasets", types.SimpleNamespace(KaggleDatasets=KaggleDatasets))
    return calls


def test_private_dataset_on_a_tpu_node_gets_credentials_then_gcs_path(kaggle, kaggle_modules, capfd, caplog):
    path = resolve_data_path("alice/private-flowers", needs_gcs=True, private=True)
    assert path == "gs://kds-0123/private-flowers"
    assert kaggle_modules == [
        ("get_gcloud_credential",),
        ("set_tensorflow_credential", True),
        ("get_gcs_path", "private-flowers"),
    ]
    out, err = capfd.readouterr()
    assert "credential handed to TensorFlow (not shown)" in out
    assert SECRET not in out + err + caplog.text
    written = [p.read_bytes() for p in kaggle.rglob("*") if p.is_file()]
    assert not any(SECRET.encode() in content for content in written)


def test_public_dataset_on_a_tpu_node_needs_no_credentials(kaggle, kaggle_modules):
    assert resolve_data_path("flowers-tfrec", needs_gcs=True) == "gs://kds-0123/flowers-tfrec"
    assert kaggle_modules == [("get_gcs_path", "flowers-tfrec")]


def test_private_gs_url_sets_credentials(kaggle, kaggle_modules):
    assert resolve_data_path("gs://bucket/x", private=True) == "gs://bucket/x"
    assert [c[0] for c in kaggle_modules] == ["get_gcloud_credential", "set_tensorflow_credential"]


def test_outside_kaggle_the_gcs_route_says_so(kaggle, monkeypatch):
    monkeypatch.setitem(sys.modules, "kaggle_datasets", None)  # import fails, as on a laptop
    with pytest.raises(DataPathError, match="kaggle_datasets exists only inside a Kaggle kernel"):
        resolve_data_path("flowers-tfrec", needs_gcs=True)


@pytest.mark.e2e
def test_a_gs_url_where_only_a_local_folder_works_is_refused_not_rewritten(
    train_argv, trained_export, demo_dir, tmp_path, monkeypatch, capsys
):
    """pathlib makes 'gs://bars-bucket/run' the local folder 'gs:/bars-bucket/run': an output there would have stayed
    on this disk and been reported as written to the bucket. Where gs:// is not taken, it is refused by name, before
    anything is written."""
    from common.launch.kernel import guarded

    from infer_gpu.infer import main as infer_main
    from tpu2gpu.cli import main as cli_main
    from train_tpu.train import main as train_main

    monkeypatch.chdir(tmp_path)
    assert cli_main(["tfrecords", "--competition", str(demo_dir), "--out", "s3://bars-bucket/tfr"]) == 2
    err = capsys.readouterr().err  # gs:// is converted there (tests/test_gcs.py)
    assert err.startswith("tpu2gpu tfrecords: error: ") and err.count("\n") == 1
    says(
        err,
        "--out='s3://bars-bucket/tfr'",
        "URL",
        "local folder",
        "'s3:/bars-bucket/tfr'",
        "Fix: a local folder",
        "`gcloud storage cp -r`",
    )
    # The training kernel's output takes gs:// (tests/test_gcs.py); its scratch folder and the inference kernel's
    # output (the submission) do not.
    assert guarded("train_tpu", train_main, train_argv("runtime.scratch_dir=gs://bars-bucket/tmp")) == 2
    says(
        capsys.readouterr().err,
        "train_tpu: error: ",
        "runtime.scratch_dir='gs://bars-bucket/tmp'",
        "URL",
        "local folder",
        "'gs:/bars-bucket/tmp'",
    )
    assert (
        guarded(
            "infer_gpu",
            infer_main,
            set_args(
                f"infer.exports=[{trained_export}]",
                f"runtime.competition_dir={demo_dir}",
                "runtime.output_dir=gs://bars-bucket/infer",
            ),
        )
        == 2
    )
    says(capsys.readouterr().err, "error: ", "runtime.output_dir='gs://bars-bucket/infer'", "URL", "local folder")
    assert not (tmp_path / "gs:").exists() and not (tmp_path / "s3:").exists()
