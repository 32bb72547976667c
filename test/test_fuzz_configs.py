"""The differential check's configurations are their seeds, and its repro scripts carry them."""

import unittest

import fuzz_differential
from fuzz_configs import make_config


class FuzzConfigsTest(unittest.TestCase):
    def test_a_configuration_is_its_seed_and_index(self) -> None:
        self.assertEqual(make_config(3, 5, 2), make_config(3, 5, 2))
        self.assertNotEqual(make_config(3, 5, 2), make_config(3, 6, 2))
        self.assertNotEqual(make_config(3, 5, 2), make_config(4, 5, 2))

    def test_repro_script_carries_the_configuration(self) -> None:
        script = fuzz_differential.repro_script(3, 5, 2)
        compile(script, "repro.py", "exec")
        namespace: dict = {}
        config_source = script.split("CONFIG = ", 1)[1].split("\n\n\n", 1)[0]
        exec(f"CONFIG = {config_source}", namespace)  # noqa: S102 - our own literal
        self.assertEqual(namespace["CONFIG"], make_config(3, 5, 2))


if __name__ == "__main__":
    unittest.main()
