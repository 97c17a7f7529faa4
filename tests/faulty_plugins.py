"""Plugins that misbehave, for the tests of how the engine reports them."""
from strata import hookimpl


class BadPicker:
    name = "bad"

    def pick(self, prompt_tokens, slots):
        return (len(slots), 0)  # a slot that does not exist


class BadPickerPlugin:
    @hookimpl
    def strata_slot_picker(self):
        return BadPicker()


class RefuseGrow:
    """A KV grow policy that lends nothing."""
    name = "refuse"

    def grow(self, slot_index, num_cells_needed, cells_per_expert_slot, residency):
        return []

    def give_back(self, slot_index, expert_slots):
        return []


class RefusePlugin:
    @hookimpl
    def strata_kv_grow(self):
        return RefuseGrow()
