"""The differential check's configurations are their seeds, and its repro scripts carry them."""

import unittest
from unittest import mock

import fuzz_differential
import fuzz_surface
from fuzz_configs import make_config


class FuzzConfigsTest(unittest.TestCase):
    def test_a_configuration_is_its_seed_and_index(self) -> None:
        self.assertEqual(make_config(3, 5, 2), make_config(3, 5, 2))
        self.assertNotEqual(make_config(3, 5, 2), make_config(3, 6, 2))
        self.assertNotEqual(make_config(3, 5, 2), make_config(4, 5, 2))

    def test_surface_axes_keep_the_other_draws(self) -> None:
        # A configuration without an axis is the one drawn before the axes
        # existed, and dropping one axis changes no other axis's draw.
        pairs = [(seed, index) for seed in range(3) for index in range(40)]
        for seed, index in pairs:
            config = make_config(seed, index, 4)
            if not config["surface"]:
                self.assertEqual(config, dict(make_config(seed, index, 4, surface=False), surface={}))
        for dropped in fuzz_surface.AXES:
            axes = {name: fn for name, fn in fuzz_surface.AXES.items() if name != dropped}
            with self.subTest(dropped=dropped), mock.patch.dict(fuzz_surface.AXES, clear=True):
                fuzz_surface.AXES.update(axes)
                without = {pair: make_config(*pair, 4)["surface"] for pair in pairs}
            for pair in pairs:
                expected = make_config(*pair, 4)["surface"]
                expected.pop(dropped, None)
                self.assertEqual(without[pair], expected)

    def test_every_surface_axis_is_drawn(self) -> None:
        drawn = {
            axis
            for index in range(200)
            for axis in make_config(0, index, 4)["surface"]
        }
        self.assertEqual(drawn, set(fuzz_surface.AXES))

    def test_repro_script_carries_the_configuration(self) -> None:
        script = fuzz_differential.repro_script(3, 5, 2)
        compile(script, "repro.py", "exec")
        namespace: dict = {}
        config_source = script.split("CONFIG = ", 1)[1].split("\n\n\n", 1)[0]
        exec(f"CONFIG = {config_source}", namespace)  # noqa: S102 - our own literal
        self.assertEqual(namespace["CONFIG"], make_config(3, 5, 2))


if __name__ == "__main__":
    unittest.main()
