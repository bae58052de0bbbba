"""The data sources: open_source picks one the same way for both kernels, the conversion and the inference kernel read
a competition's test images through the same samples, and the conversion reads any SampleSource."""

import json

from common.core.config import load_config
from common.core.errors import UserError
from common.data.conversion import convert_competition
from common.data.samples import CompetitionFolder
from common.data.sources import CompetitionSource, RecordSource, open_source

import pytest

from builders import write_competition


def test_open_source_takes_the_records_first_then_the_competition_folder(tmp_path):
    comp, records = write_competition(tmp_path / "comp", ["a", "b"] * 3), tmp_path / "records"
    records.mkdir()
    both = open_source(load_config(None, [f"runtime.tfrecords={records}", f"runtime.competition_dir={comp}"]))
    assert both == RecordSource(str(records.resolve()), both.data_cfg)
    assert both.training_records(tmp_path / "scratch") == str(records.resolve())
    folder = open_source(load_config(None, [f"runtime.competition_dir={comp}"]))
    assert isinstance(folder, CompetitionSource) and folder.folder.root == comp.resolve()
    with pytest.raises(UserError, match="set runtime.tfrecords .* or runtime.competition_dir"):
        open_source(load_config(None, []))


def test_conversion_and_inference_read_the_test_images_one_way(tmp_path):
    comp = write_competition(tmp_path / "comp", ["a", "b"] * 3, n_test=5)
    folder = CompetitionFolder(comp, load_config(None, []).data)
    converted = folder.test_samples()  # what the conversion writes: sample_submission.csv's order
    assert [s.id for s in converted] == ["t004", "t003", "t002", "t001", "t000"]
    ids = [s.id for s in converted]
    assert [s.path for s in folder.test_samples(ids[::-1])] == [s.path for s in converted][::-1]  # the inference kernel

    (comp / "test" / "t003.jpg").unlink()
    # The conversion reports it as bad; the inference kernel names it and predicts it with the fallback (test_unread)
    assert [s.id for s in folder.test_samples() if s.path is None] == ["t003"]


class FirstSamples:
    """A SampleSource of the tests' own: the first n labelled rows of a competition folder, no test set."""

    def __init__(self, folder: CompetitionFolder, n: int):
        self.folder, self.n = folder, n

    def train_samples(self):
        samples, class_names, label_type = self.folder.train_samples()
        return samples[: self.n], class_names, label_type

    def test_samples(self, ids=None):
        return []

    def provenance(self) -> dict:
        return {"first_rows_of": str(self.folder.root), "rows": self.n}


def test_the_conversion_reads_any_sample_source(tmp_path):
    comp = write_competition(tmp_path / "comp", ["a", "b", "c"] * 8)
    data_cfg = load_config(None, ["data.folds=2"]).data
    manifest = convert_competition(FirstSamples(CompetitionFolder(comp, data_cfg), 12), tmp_path / "out", data_cfg)
    assert manifest["source"] == {"first_rows_of": str(comp), "rows": 12}
    assert {name: split["count"] for name, split in manifest["splits"].items()} == {"fold0": 6, "fold1": 6}
    assert manifest["class_names"] == ["a", "b", "c"]
    assert json.loads((tmp_path / "out" / "manifest.json").read_text()) == manifest
