import torch
from memfit.tensors import optimizer_tensors, sole_owner, storage_key


def test_storage_key_names_the_storage_not_the_view():
    x = torch.zeros(16)
    assert storage_key(x.untyped_storage()) == storage_key(x[4:].view(3, 4).untyped_storage())
    assert storage_key(x.untyped_storage()) != storage_key(torch.zeros(16).untyped_storage())


def test_sole_owner_counts_tensors_and_known_holders():
    x = torch.zeros(16)
    storage = x.untyped_storage()
    assert not sole_owner(storage)  # x still refers to it
    assert sole_owner(storage, extra_references=1)  # ... unless the caller counts x as a known holder
    del x
    assert sole_owner(storage)


def test_optimizer_tensors_lists_params_states_and_gradients_if_asked():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    params = {id(p) for p in model.parameters()}
    without = list(optimizer_tensors(opt, gradients=False))
    with_grads = list(optimizer_tensors(opt, gradients=True))
    assert params <= {id(t) for t in without}
    assert len(without) == 2 + 2 * 3  # weight, bias; per parameter: step, exp_avg, exp_avg_sq
    assert {id(p.grad) for p in model.parameters()} <= {id(t) for t in with_grads}
    assert len(with_grads) == len(without) + 2
