"""The reference's connector package surface."""

from afd_plugin.connectors.base import AFDConnectorBase, AFDControlPlane, ConnectorExtraInfo
from afd_plugin.connectors.factory import AFDConnectorFactory
from afd_plugin.connectors.metadata import (
    AFDA2FTransferPayload,
    AFDControlPayload,
    AFDDPMetadata,
    AFDExpertRoutingSpec,
    AFDForwardContextMetadata,
    AFDTransferContext,
    AFDTransferMetadata,
    AFDTransferState,
)

__all__ = [
    "AFDConnectorBase", "AFDControlPlane", "ConnectorExtraInfo", "AFDConnectorFactory",
    "AFDA2FTransferPayload", "AFDControlPayload", "AFDDPMetadata", "AFDExpertRoutingSpec",
    "AFDForwardContextMetadata", "AFDTransferContext", "AFDTransferMetadata", "AFDTransferState",
]
