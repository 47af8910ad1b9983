"""The gather of scattered store rows (fxreplace/gather.py): the C loop built with the
package and the index_select it stands in for give the same bits, into whole contexts and
into leading() views, on one thread and several; a bad row is refused before anything is
written."""

import contextlib
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fxreplace import gather
from fxreplace.gather import gather_rows, index_select_rows

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.bool]


@contextlib.contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.bool else t.view(torch.int8)  # NaN != NaN: compare the bits


def _values(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-128, 128, (*shape[:-1], shape[-1] * torch.empty((), dtype=dtype).element_size()),
                         generator=g, dtype=torch.int8)
    return bits.view(dtype)  # every bit pattern: NaN payloads and -0.0 must survive the copy


def test_the_c_gather_is_built_where_the_tests_run():
    assert gather.NATIVE, ("fxreplace._gather was not built: install a C compiler with OpenMP (gcc) and Python's "
                           "headers, and reinstall the package; without it large decode batches gather with index_select, up to 1.6x slower")


@settings(max_examples=40, deadline=None)
@given(modules=st.integers(1, 5), stored=st.integers(1, 40), width=st.sampled_from([1, 3, 32, 128]),
       dtype=st.sampled_from(DTYPES), data=st.data(), spare=st.integers(0, 3), workers=st.sampled_from([1, 2]),
       native=st.booleans())
def test_gather_rows_copies_every_bit_of_the_asked_rows(modules, stored, width, dtype, data, spare, workers, native):
    rows = torch.tensor(data.draw(st.lists(st.integers(0, stored - 1), max_size=70)), dtype=torch.int64)
    src = _values((modules, stored, width), dtype, seed=len(rows))
    whole = _values((modules, len(rows) + spare, width), dtype, seed=7)  # dst: the leading slots of a larger context
    before = whole.clone()
    dst = whole[:, : len(rows)]
    with threads(workers):
        (gather_rows if native else index_select_rows)(src, dst, rows)
    assert torch.equal(bits(dst), bits(src)[:, rows])
    assert torch.equal(bits(whole)[:, len(rows):], bits(before)[:, len(rows):])  # the slots after the view: untouched


def test_a_row_outside_the_source_is_refused_before_anything_is_written():
    src = torch.randn(3, 10, 8)
    dst = torch.zeros(3, 4, 8)
    with pytest.raises(IndexError, match="slot 2 asks for row 10 of a source of 10 rows"):
        gather_rows(src, dst, torch.tensor([0, 1, 10, 2]))
    assert not dst.any()


def test_the_c_gather_loads_no_openmp_runtime_of_its_own():
    """The C loop is linked against the libgomp.so.1 soname, which the process has from torch:
    a second OpenMP runtime would spin its own threads against torch's after every op. (Other
    packages may bring their own, e.g. sentencepiece: the check runs in a fresh interpreter.)"""
    script = textwrap.dedent("""
        import json
        import torch
        def runtimes():
            return {line.split()[-1] for line in open("/proc/self/maps") if "gomp" in line or "iomp" in line}
        before = runtimes()
        from fxreplace import _gather
        from fxreplace.gather import gather_rows, index_select_rows
        src = torch.randn(48, 4096, 128).to(torch.bfloat16)
        rows = torch.randint(0, 4096, (512,))
        dst = torch.empty(48, 512, 128, dtype=torch.bfloat16)
        torch.set_num_threads(2)
        gather_rows(src, dst, rows)
        assert torch.equal(dst.view(torch.int16), src.view(torch.int16)[:, rows])
        print(json.dumps([sorted(before), sorted(runtimes())]))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    before, after = json.loads(done.stdout)
    assert any("libgomp" in path for path in before) and after == before, done.stdout


def test_an_output_whose_modules_share_memory_is_refused_not_overwritten():
    src = torch.randn(3, 10, 8)
    dst = torch.zeros(1, 4, 8).expand(3, 4, 8)  # one buffer seen as three modules
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        gather_rows(src, dst, torch.tensor([0, 1, 2, 3]))


def test_gathers_from_several_threads_at_once_each_get_their_own_rows():
    """The C loop releases the GIL: builds on two threads (two engines' steps) run it at once."""
    import threading

    src = _values((8, 2048, 64), torch.bfloat16, seed=3)
    jobs = [(torch.randint(0, 2048, (300,), generator=torch.Generator().manual_seed(i)),
             torch.empty(8, 300, 64, dtype=torch.bfloat16)) for i in range(4)]
    failures = []

    def work(rows, dst):
        for _ in range(30):
            dst.zero_()
            gather_rows(src, dst, rows)
            if not torch.equal(bits(dst), bits(src)[:, rows]):
                failures.append(rows[:4].tolist())

    with threads(2):
        workers = [threading.Thread(target=work, args=job) for job in jobs]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    assert not failures
