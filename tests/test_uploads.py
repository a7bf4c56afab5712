"""The CPU lane's uploads issued from a helper thread (dos/uploads.py): order, errors, and the
engine's results with the thread against inline uploads and the oracle."""
import random
import threading
import time

import pytest
import torch

import dos
from dos import uploads
from dos.lanes import Lanes

from helpers import DEVICES, batch, loss_fn, make_model, max_diff, pair, train


def test_uploads_run_in_submission_order_and_join_waits_for_all():
    up, done, rng = uploads.UploadThread(torch.device("cpu")), [], random.Random(0)
    for i in range(40):
        delay = rng.random() * 1e-3
        up.submit(lambda i=i, d=delay: (time.sleep(d), done.append(i)))
    up.join()
    assert done == list(range(40))  # in order, and all of them before join() returned
    up.join()  # nothing pending: returns at once
    up.close()


def test_join_reraises_the_first_error_after_every_upload_ran():
    up, done = uploads.UploadThread(torch.device("cpu")), []

    def fail(msg):
        raise ValueError(msg)

    up.submit(lambda: done.append(0))
    up.submit(lambda: fail("first"))
    up.submit(lambda: fail("second"))
    up.submit(lambda: done.append(3))
    with pytest.raises(RuntimeError, match="upload failed") as e:
        up.join()
    assert str(e.value.__cause__) == "first" and done == [0, 3]
    up.submit(lambda: done.append(4))  # usable afterwards
    up.join()
    assert done == [0, 3, 4]
    up.close()


def test_the_thread_ends_with_its_owner():
    before = set(threading.enumerate())
    up = uploads.UploadThread(torch.device("cpu"))
    up.submit(lambda: None)
    up.join()
    (t,) = [t for t in set(threading.enumerate()) - before if t.name.startswith("dos-upload")]
    del up
    t.join(timeout=10)
    assert not t.is_alive()


@pytest.mark.parametrize("env,device,on", [("", "cpu", False), ("", "cuda", False), ("0", "cuda", False),
                                           ("0", "cpu", False), ("1", "cpu", True), ("1", "cuda", True)])
def test_enabled(monkeypatch, env, device, on):
    monkeypatch.setenv("DOS_UPLOAD_THREAD", env)
    assert uploads.enabled(torch.device(device)) is on


def test_enabled_rejects_other_values(monkeypatch):
    monkeypatch.setenv("DOS_UPLOAD_THREAD", "yes")
    with pytest.raises(ValueError, match="DOS_UPLOAD_THREAD"):
        uploads.enabled(torch.device("cuda"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype,dtype", [("fp32", torch.float32), ("bf16-split", torch.bfloat16)])
def test_threaded_uploads_train_bitwise_as_inline_ones(monkeypatch, device, state_dtype, dtype):
    """The same run with uploads on the helper thread and on the calling thread: bitwise equal
    weights; fp32 also equals the oracle (torch AdamW on fp32 masters)."""
    runs = {}
    for env in ("1", "0"):
        monkeypatch.setenv("DOS_UPLOAD_THREAD", env)
        a, opt, b, ref = pair("transformer", device, dtype, subgroup_numel=1000, placement="cpu",
                              state_dtype=state_dtype)
        assert (opt._lanes.uploader is not None) == (env == "1")
        assert opt.describe()["upload_thread"] == (env == "1")  # in every run record
        assert len(opt._lanes.plan.cpu_order) >= 3
        la = train("transformer", a, opt, 6, device)
        runs[env] = [p.detach().clone() for p in a.parameters()]
        if state_dtype == "fp32":
            train("transformer", b, ref, 6, device)
            assert max_diff(a, b) <= 1e-5
        assert la[-1] < la[0]
        opt.close()
    assert all(torch.equal(x, y) for x, y in zip(runs["1"], runs["0"]))


def test_an_upload_error_reaches_step_and_nothing_runs_after_it(monkeypatch):
    monkeypatch.setenv("DOS_UPLOAD_THREAD", "1")
    model = make_model("transformer")
    opt = dos.DeepOptimizerStates(model.parameters(), lr=1e-3, placement="cpu", subgroup_numel=1000)
    order = list(opt._lanes.plan.cpu_order)
    bad, issued = order[1], []
    real = Lanes._upload

    def upload(self, s, weights, spans):
        if s == bad:
            time.sleep(0.01)  # the main thread is further along by now
            raise OSError("copy failed")
        issued.append(s)
        return real(self, s, weights, spans)

    monkeypatch.setattr(Lanes, "_upload", upload)
    x, y = batch("transformer", 0)
    loss_fn("transformer", model, x, y).backward()
    with pytest.raises(RuntimeError, match="upload failed") as e:
        opt.step()
    assert isinstance(e.value.__cause__, OSError)
    # every other subgroup's upload was still issued before step() raised
    assert sorted(issued) == sorted(s for s in order if s != bad)
    assert opt._lanes.uploader._pending == []
    opt.close()


def test_the_gradient_ring_keeps_its_uploads_on_the_calling_thread(monkeypatch):
    """Its (j+K)-th gradient goes down once the j-th upload's event exists (dos.grads._RingFeed)."""
    monkeypatch.setenv("DOS_UPLOAD_THREAD", "1")
    a, opt, b, ref = pair("transformer", subgroup_numel=1000, placement="cpu", grad_ring=2)
    assert opt._lanes.uploader is None  # no helper thread: every upload on the calling thread
    train("transformer", a, opt, 3)
    train("transformer", b, ref, 3)
    assert max_diff(a, b) <= 1e-5
