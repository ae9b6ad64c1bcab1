//! The protobuf codec of every generated Talos client and server: prost's, with a small first buffer
//! for the messages it sends.
//!
//! tonic gives every call its own encode buffer, 8 KiB to start with, held for as long as the call is
//! in flight. The controller's requests are a few bytes to a few hundred (a machine config patch is the
//! largest, and the buffer grows for it), but it makes thousands of calls at once when many clusters
//! are upgrading: at 1,000 nodes those first buffers were 13 MB of the controller's peak heap. Replies
//! are decoded with tonic's default buffer, since Talos's answers (machine configs, COSI resources) are
//! often kilobytes.

use std::marker::PhantomData;

use prost::Message;
use tonic::codec::{BufferSettings, Codec};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

/// The first size of a message's encode buffer. It grows as needed; a message larger than this
/// costs a reallocation, not an error.
const ENCODE_BUFFER_BYTES: usize = 512;

/// tonic's default: a streamed reply is handed on in chunks of this size at most.
const YIELD_THRESHOLD_BYTES: usize = 32 * 1024;

/// [`ProstCodec`] with a [`ENCODE_BUFFER_BYTES`] first encode buffer; named by `build.rs` as the codec
/// of the generated code.
#[derive(Debug, Clone)]
pub struct TalosCodec<T, U> {
    _messages: PhantomData<(T, U)>,
}

impl<T, U> Default for TalosCodec<T, U> {
    fn default() -> Self {
        TalosCodec {
            _messages: PhantomData,
        }
    }
}

impl<T, U> Codec for TalosCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::raw_encoder(BufferSettings::new(
            ENCODE_BUFFER_BYTES,
            YIELD_THRESHOLD_BYTES,
        ))
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstCodec::<T, U>::raw_decoder(BufferSettings::default())
    }
}
