"""accord.torch without processes: version checks and install errors."""

import pytest
import torch

import accord.torch as at


@pytest.mark.parametrize("v", ["2.9.0", "2.10.1+cpu", "2.13.0", "2.13.0a0+git123"])
def test_supported_versions_pass(v):
    at.check_torch_version(v)


@pytest.mark.parametrize("v", ["2.8.2", "2.14.0", "3.0.0", "1.13.1"])
def test_unsupported_versions_fail_clearly(v):
    with pytest.raises(at.UnsupportedTorchError, match=r"supports torch 2\.9 through 2\.13"):
        at.check_torch_version(v)


def test_installed_torch_is_supported():
    at.check_torch_version()


class _Agreement:
    rank, world_size = 0, 1

    def register(self, *a):
        pass

    def submit(self, *a):
        raise AssertionError("not reached")


def test_install_on_a_model_without_fsdp_says_so():
    with pytest.raises(ValueError, match="no FSDP2 parameter groups"):
        at.install(torch.nn.Linear(2, 2), _Agreement())


def test_install_rejects_something_that_is_not_an_agreement():
    with pytest.raises(TypeError, match="accord client"):
        at.install(torch.nn.Linear(2, 2), object())
