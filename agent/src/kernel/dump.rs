//! Reading a BPF iterator's output: records written by `bpf_seq_write`, decoded as they are
//! read through a small reused buffer (a dump is never held in memory as bytes).
use std::{
    io::Read as _,
    time::{Duration, Instant},
};

use aya::programs::Iter;
use connreap_ebpf::{HeldElsewhere, OwnerRecord};

use super::IterError;

/// What one iterator dump was: its records, and the time spent in `read`, i.e. in the kernel
/// producing them.
#[derive(Debug, Default, Clone, Copy)]
pub struct Dump {
    pub records: usize,
    /// Time in read(): the iterator producing records.
    pub in_kernel: Duration,
    /// The whole dump: attach, reads, and decoding the records.
    pub total: Duration,
}

/// Run `it` and hand the bytes read so far to `decode`, which returns how many of them it
/// consumed (whole records) and how many records those were; the rest is kept for the next
/// read.
fn run(it: &mut Iter, mut decode: impl FnMut(&[u8]) -> (usize, usize)) -> Result<Dump, IterError> {
    let start = Instant::now();
    let id = it.attach()?;
    let link = it.take_link(id)?;
    let mut file = link.into_file()?;
    let mut buf = vec![0u8; 64 * 1024];
    let mut filled = 0;
    let mut dump = Dump::default();
    loop {
        let t = Instant::now();
        let read = file.read(&mut buf[filled..]);
        dump.in_kernel += t.elapsed();
        let n = match read {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        };
        filled += n;
        let (used, records) = decode(&buf[..filled]);
        dump.records += records;
        buf.copy_within(used..filled, 0);
        filled -= used;
    }
    dump.total = start.elapsed();
    Ok(dump)
}

/// A dump of fixed-size records, each handed to `f`.
pub(super) fn fixed<T: aya::Pod>(it: &mut Iter, mut f: impl FnMut(T)) -> Result<Dump, IterError> {
    run(it, |buf| {
        let whole = buf.len() - buf.len() % std::mem::size_of::<T>();
        let mut n = 0;
        records::<T>(&buf[..whole]).for_each(|r| {
            n += 1;
            f(r)
        });
        (whole, n)
    })
}

/// What a dump of owners that also reads other namespaces' sockets hands its caller.
pub enum Owned {
    /// A socket's owner.
    Owner(OwnerRecord),
    /// A TCP socket of another namespace than the reader's, with its owner.
    Elsewhere(HeldElsewhere),
}

/// A dump of owner records, each followed by its socket's record where `netns` is set (see
/// [`OwnerRecord::netns`]); records counts the owners.
pub(super) fn owned(it: &mut Iter, mut f: impl FnMut(Owned)) -> Result<Dump, IterError> {
    run(it, |buf| decode_owned(buf, &mut f))
}

/// Decode the whole records at the start of `buf`: (bytes used, records).
fn decode_owned(buf: &[u8], f: &mut impl FnMut(Owned)) -> (usize, usize) {
    const OWNER: usize = std::mem::size_of::<OwnerRecord>();
    const PAIR: usize = std::mem::size_of::<HeldElsewhere>();
    let (mut at, mut n) = (0, 0);
    while let Some(owner) = buf.get(at..at + OWNER).map(read::<OwnerRecord>) {
        if owner.netns == 0 {
            f(Owned::Owner(owner));
            at += OWNER;
        } else if let Some(pair) = buf.get(at..at + PAIR) {
            f(Owned::Elsewhere(read(pair)));
            at += PAIR;
        } else {
            break;
        }
        n += 1;
    }
    (at, n)
}

/// Fixed-size records written by `bpf_seq_write`; a trailing partial record is ignored.
fn records<T: aya::Pod>(buf: &[u8]) -> impl Iterator<Item = T> + '_ {
    buf.chunks_exact(std::mem::size_of::<T>()).map(read)
}

/// A record from exactly `size_of::<T>()` bytes.
fn read<T: aya::Pod>(chunk: &[u8]) -> T {
    assert_eq!(chunk.len(), std::mem::size_of::<T>());
    // SAFETY: T is Pod (any bit pattern is a valid T) and chunk has exactly size_of::<T>()
    // bytes (checked above); read_unaligned allows any alignment of the buffer.
    unsafe { std::ptr::read_unaligned(chunk.as_ptr().cast::<T>()) }
}

#[cfg(test)]
mod tests {
    use connreap_ebpf::SockRecord;

    use super::*;

    fn bytes<T: aya::Pod>(r: &T) -> &[u8] {
        // SAFETY: reading the bytes of a Pod record.
        unsafe { std::slice::from_raw_parts(r as *const T as *const u8, std::mem::size_of::<T>()) }
    }

    fn owner(skaddr: u64, netns: u32) -> OwnerRecord {
        OwnerRecord {
            skaddr,
            tgid: 42,
            fd: 7,
            comm: *b"java\0\0\0\0\0\0\0\0\0\0\0\0",
            netns,
            _pad: 0,
        }
    }

    #[test]
    fn decodes_records_and_ignores_partial_tail() {
        let a = owner(0xffff_8880_1234_5678, 0);
        let mut buf = Vec::new();
        for _ in 0..2 {
            buf.extend_from_slice(bytes(&a));
        }
        buf.extend_from_slice(&[1, 2, 3]);
        let recs: Vec<OwnerRecord> = records(&buf).collect();
        assert_eq!(recs, vec![a, a]);
    }

    /// Owners and owner + socket pairs interleaved, cut at every byte: each record comes once,
    /// whole, and a cut pair waits for its socket's bytes.
    #[test]
    fn owners_and_sockets_elsewhere_decode_across_any_cut() {
        let pair = HeldElsewhere {
            owner: owner(2, 4026532001),
            sock: SockRecord {
                skaddr: 2,
                inode: 99,
                sport: 8080,
                ..SockRecord::default()
            },
        };
        let mut stream = Vec::new();
        stream.extend_from_slice(bytes(&owner(1, 0)));
        stream.extend_from_slice(bytes(&pair));
        stream.extend_from_slice(bytes(&owner(3, 0)));
        for cut in 0..=stream.len() {
            let mut seen = Vec::new();
            let mut f = |o: Owned| {
                seen.push(match o {
                    Owned::Owner(o) => (o.skaddr, None),
                    Owned::Elsewhere(p) => (p.owner.skaddr, Some((p.owner.netns, p.sock.sport))),
                })
            };
            let (used, n1) = decode_owned(&stream[..cut], &mut f);
            let mut rest = stream[used..cut].to_vec();
            rest.extend_from_slice(&stream[cut..]);
            let (used2, n2) = decode_owned(&rest, &mut f);
            assert_eq!(used2, rest.len(), "cut at {cut}");
            assert_eq!(n1 + n2, 3, "cut at {cut}");
            assert_eq!(
                seen,
                vec![(1, None), (2, Some((4026532001, 8080))), (3, None)],
                "cut at {cut}"
            );
        }
    }
}
