"""pytest plugin (``-p afd_ext_as_connector``): afd_ext replaces afd-plugin's connector in its own unit tests.

Loads vLLM's general plugins at start-up as a vLLM process does; run with ``VLLM_PLUGINS=afd_ext``
(afd-plugin's own start-up patches are left out, as its unit tests expect) and
``AFD_EXT_REPLACE_P2P=1``, so afd-plugin's factory resolves ``P2pNcclAFDConnector`` to afd_ext.
"""


def pytest_configure(config):
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from afd_plugin.connectors.factory import AFDConnectorFactory

    cls = AFDConnectorFactory.get_connector_class("P2pNcclAFDConnector")
    assert cls.__module__ == "afd_ext.integrations.afd_plugin", f"P2pNcclAFDConnector is {cls}, not afd_ext's"
