"""Accelerate's ``test_utils/scripts/test_distributed_data_loop.py`` checks, in its ``main()``'s
order, on lowprec (run by tests/test_accelerate_scripts.py on 2 processes, Accelerate's objects
rebound to lowprec's). Left out, for its reason:

- ``test_stateful_dataloader`` / ``test_stateful_dataloader_save_state`` need torchdata's
  ``StatefulDataLoader`` (``use_stateful_dataloader=True``), which lowprec does not build: its own
  loaders save their position in ``save_state``.
"""

from unittest import mock

from accelerate.test_utils.scripts import test_distributed_data_loop as T
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, default_collate

from lowprec import DistributedType


def main() -> None:
    accelerator = T.create_accelerator()
    T.test_default_ensures_even_batch_sizes()
    T.test_can_disable_even_batches()
    T.test_can_join_uneven_inputs()
    T.test_join_can_override_even_batches()
    T.test_join_can_override_for_mixed_type_dataloaders()
    T.test_join_raises_warning_for_iterable_when_overriding_even_batches()
    with mock.patch.object(accelerator.state, "distributed_type", DistributedType.FSDP):
        T.test_join_raises_warning_for_non_ddp_distributed(accelerator)
    T.test_pickle_accelerator()
    dataset = T.DummyDataset()
    T.test_data_loader(
        DataLoader(dataset, shuffle=False, batch_size=T.BATCH_SIZE, num_workers=T.NUM_WORKERS), accelerator
    )
    T.test_data_loader(
        DataLoader(dataset, shuffle=True, batch_size=T.BATCH_SIZE, num_workers=T.NUM_WORKERS), accelerator
    )
    sampler = BatchSampler(RandomSampler(dataset), batch_size=T.BATCH_SIZE, drop_last=False)
    T.test_data_loader(DataLoader(dataset, batch_sampler=sampler, num_workers=T.NUM_WORKERS), accelerator)
    sampler = BatchSampler(RandomSampler(dataset), batch_size=T.BATCH_SIZE, drop_last=False)
    T.test_data_loader(
        DataLoader(dataset, sampler=sampler, batch_size=None, collate_fn=default_collate, num_workers=T.NUM_WORKERS),
        accelerator,
    )
    accelerator.end_training()
    if accelerator.process_index == 0:
        print("accelerate test_distributed_data_loop checks: all passed")


if __name__ == "__main__":
    main()
