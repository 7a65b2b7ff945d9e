"""The order the suite runs in (conftest.py's pytest_collection_modifyitems, with
scripts/test.sh's --dist loadfile): the longest files first, each file's tests together and in
their own order, and the cost table naming only files that exist."""
import conftest
from support import REPO


class _Item:
    def __init__(self, nodeid):
        self.nodeid = nodeid


def test_the_cost_table_names_test_files_that_exist():
    assert conftest.FILE_SECONDS
    for path, seconds in conftest.FILE_SECONDS.items():
        assert (REPO / path).is_file() and path.startswith("tests/") and path.endswith(".py"), path
        assert seconds > 0, path


def test_longest_files_first_each_file_together_in_its_order():
    long, longer = sorted(conftest.FILE_SECONDS, key=conftest.FILE_SECONDS.get)[-2:]
    ids = ["tests/a.py::t1", f"{long}::x", "tests/b.py::t1", f"{longer}::y1", "tests/a.py::t2", f"{longer}::y0",
           "tests/b.py::t0[p]"]
    items = [_Item(i) for i in ids]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == [f"{longer}::y1", f"{longer}::y0", f"{long}::x", "tests/a.py::t1",
                                         "tests/a.py::t2", "tests/b.py::t1", "tests/b.py::t0[p]"]
    # An unlisted file counts by its tests: three of them outweigh two.
    items = [_Item(i) for i in ("tests/a.py::t1", "tests/a.py::t2", "tests/b.py::t1", "tests/b.py::t2",
                                "tests/b.py::t3")]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid.split("::")[0] for i in items] == ["tests/b.py"] * 3 + ["tests/a.py"] * 2


def test_the_suite_script_hands_out_whole_files_in_this_order():
    script = (REPO / "scripts" / "test.sh").read_text()
    assert "--dist loadfile" in script and "--no-loadscope-reorder" in script
