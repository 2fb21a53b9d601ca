"""Accelerate's ``test_utils/scripts/test_script.py`` checks, in its ``main()``'s order, on lowprec
(run by tests/test_accelerate_scripts.py, with Accelerate's objects rebound to lowprec's). Two of
them are left out, each for a reason of lowprec's design, not a defect a script meets:

- ``check_seedable_sampler_in_batch_sampler_shard`` asserts that ``prepare_data_loader`` put
  Accelerate's ``SeedableRandomSampler`` under ``batch_sampler.batch_sampler.sampler``; lowprec
  keeps the user's ``RandomSampler`` there and shuffles it with ``data_seed + epoch`` (the same
  order: tests/test_data_loader_parity.py).
- ``main()`` keeps the first Accelerator's ``state`` across the checks that reset every state
  (``AcceleratorState._reset_state()``); lowprec's states are one per Accelerator, not shared, so a
  state read after a reset is refused with Accelerate's message. The checks after that point run
  here with a fresh state (``test_reinstantiated_state`` checks that message).
"""

from accelerate.test_utils.scripts import test_script as T

from lowprec import Accelerator, DistributedType, PartialState


def main() -> None:
    accelerator = Accelerator()
    T.init_state_check()
    accelerator.wait_for_everyone()
    T.process_execution_check()
    T.test_split_between_processes_list()
    T.test_split_between_processes_nested_dict()
    T.test_split_between_processes_tensor()
    T.test_split_between_processes_evenly()
    from datasets import Dataset

    T.test_split_between_processes_dataset(Dataset)
    T.rng_sync_check()
    T.dl_preparation_check()
    T.central_dl_preparation_check()
    T.custom_sampler_check()
    T.check_seedable_sampler()
    T.check_seedable_sampler_with_data_seed()
    assert PartialState().distributed_type != DistributedType.DEEPSPEED
    T.training_check(use_seedable_sampler=False)
    T.training_check(use_seedable_sampler=True)
    T.test_trigger()
    T.test_reinstantiated_state()
    PartialState().destroy_process_group()
    if PartialState().process_index == 0:
        print("accelerate test_script checks: all passed")


if __name__ == "__main__":
    main()
