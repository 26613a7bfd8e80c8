"""Running a compiled JAX executable on tensors of the JAX device (``JaxExecutable``).

Per call it
1. reads each input's JAX array (``device.read``; a host tensor, such as a 0-d step
   count, is uploaded), and lets go of the argument list (a backward's saved tensors
   are then held by nobody but this call);
2. donates the inputs the graph overwrites where each holds its storage's whole array
   alone (else the executable built without donation runs: a donor that is a view of a
   larger storage, or one passed twice, would lose the rest of its storage);
3. runs the executable with a fresh key where the graph draws random numbers;
4. installs each overwritten input's new value as its storage's array (a donated input's
   old array is deleted by JAX: nothing else holds it, ``device.Buffer``), or writes it
   through where the input is part of a storage, or copies it to the host for a host
   input; and
5. returns the outputs as new tensors of the device, and an input the graph returns as it
   is as that input (``interpret.Program.passed_through``: the executable does not return
   it, which would copy it).

Nothing waits for the device: JAX runs the executable asynchronously, and every
result is an array that later reads wait for.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from . import device


class JaxExecutable:
    """A compiled graph; call it with the flat list of graph inputs (boxed)."""

    def __init__(self, name: str, compiled, plain: Callable, on_call: Optional[Callable] = None,
                 host=None, host_outputs: tuple = ()) -> None:
        self._boxed_call = True  # an instance attribute: dynamo's disable() copies __dict__
        self.graph_name = name
        self.compiled = compiled  # stages.Compiled: donating where the graph overwrites inputs
        self._plain = plain  # () -> stages.Compiled without donation, built on first need
        self._on_call = on_call
        self.calls_without_donation = 0
        self.program = compiled.lowered.traced.program
        self._donors = compiled.lowered.donors
        self._where: Optional[torch.device] = None
        # ``analysis.host_part.HostPart``: the host inputs' new values and the host outputs,
        # computed on the CPU; ``host_outputs``: the other outputs the caller gets on the host
        self._host = host
        self._on_host_written = {i for i, _ in host.writebacks} if host is not None else set()
        self._host_outputs = frozenset(host_outputs)

    def __call__(self, args: list):
        tensors = list(args)
        args.clear()  # boxed: the caller let go of them
        arrays = [self._array(t) for t in tensors]
        compiled = self.compiled if self._can_donate(tensors, arrays) else self._without_donation()
        inputs = [a for i, a in enumerate(arrays) if i not in self.program.size_inputs]
        if self.program.random:
            inputs.append(device.device_module().next_key())
        on_host = self._host(tensors) if self._host is not None else ()  # before any input changes
        outputs, new_values = compiled.executable(*inputs)
        del inputs, arrays
        for write, value in zip(self.program.writes, new_values):
            if write.input_index not in self._on_host_written:
                self._install(tensors[write.input_index], value)
        if self._host is not None:
            with torch.no_grad():
                for input_index, k in self._host.writebacks:
                    tensors[input_index].copy_(on_host[k])
        passed = self.program.passed_through
        result = [tensors[passed[i]] if i in passed else self._output(i, v, tensors) for i, v in enumerate(outputs)]
        if self._host is not None:
            for position, k in self._host.outputs:
                result[position] = on_host[k]
        if self._on_call is not None:
            self._on_call(tensors, result)
        return result

    def _output(self, position: int, value, tensors):
        if not _is_array(value):
            return value
        if position in self._host_outputs:  # an output on the host, computed on the device
            from .lowerings import to_torch_dtype

            return device.array_to_host(value, to_torch_dtype(value.dtype))
        return device.wrap(value, self._device(tensors))

    @staticmethod
    def _array(value):
        if isinstance(value, torch.Tensor):
            return device.read(value) if value.device.type == device.NAME else device.from_host(value)
        return value

    def _device(self, tensors) -> torch.device:
        if self._where is None:
            found = [t for t in tensors if isinstance(t, torch.Tensor) and t.device.type == device.NAME]
            self._where = found[0].device if found else torch.device(device.NAME, 0)
        return self._where

    def _can_donate(self, tensors, arrays) -> bool:
        """Each donor holds its storage's whole array, no other input shares its storage."""
        if not self._donors:
            return True
        storages = [t.untyped_storage() for t in tensors if isinstance(t, torch.Tensor)]
        ids = [id(s) for s in storages]  # the storages' Python objects are kept per storage
        for i in self._donors:
            t = tensors[i]
            if t.device.type != device.NAME or not device.covers_storage(t):
                return False
            if ids.count(id(t.untyped_storage())) > 1:
                return False
            if device.buffer_of(t).array is not arrays[i]:
                return False
        return True

    def _without_donation(self):
        self.calls_without_donation += 1
        return self._plain()

    @staticmethod
    def _install(target: torch.Tensor, value) -> None:
        with torch.no_grad():
            if target.device.type != device.NAME:
                target.copy_(device.array_to_host(value, target.dtype))  # a host input: waits for the device
            elif device.covers_storage(target):
                device.holds(target, value)
            else:
                device.write(target, value)


def _is_array(value) -> bool:
    import jax

    return isinstance(value, jax.Array)
