//! Times and durations as egress-fence writes them: in its records (RFC 3339, UTC) and for
//! people (a clock time, minutes and seconds). Pure: the caller says what time it is.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// `2026-01-31T12:34:56Z`: the time of generations and pending confirmations.
pub fn rfc3339(t: SystemTime) -> String {
    let secs = unix_seconds(t);
    let (year, month, day) = civil_from_days((secs / 86_400) as i64);
    format!("{year:04}-{month:02}-{day:02}T{}Z", time_of_day(secs))
}

/// `YYYY-MM-DDTHH:MM:SS.mmmZ` for a Unix time in seconds and milliseconds; `None` before
/// year 0 or past year 9999, which RFC 3339 cannot write, and for more than 999 milliseconds.
pub fn rfc3339_millis(secs: i64, millis: u32) -> Option<String> {
    let days = secs.div_euclid(86_400);
    let of_day = secs.rem_euclid(86_400);
    // civil_from_days shifts the epoch by this many days.
    days.checked_add(719_468)?;
    let (year, month, day) = civil_from_days(days);
    if !(0..=9999).contains(&year) || millis > 999 {
        return None;
    }
    Some(format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        of_day / 3600,
        of_day / 60 % 60,
        of_day % 60
    ))
}

/// [`rfc3339_millis`] of a system time: the time of `watch`'s events (1970 for a time before
/// it or past what RFC 3339 can write).
pub fn rfc3339_millis_at(t: SystemTime) -> String {
    let (secs, millis) = match t.duration_since(UNIX_EPOCH) {
        Ok(d) => (
            i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
            d.subsec_millis(),
        ),
        Err(_) => (0, 0),
    };
    rfc3339_millis(secs, millis).unwrap_or_else(|| "1970-01-01T00:00:00.000Z".into())
}

/// `12:34:56 UTC`.
pub fn clock_utc(t: SystemTime) -> String {
    format!("{} UTC", time_of_day(unix_seconds(t)))
}

/// `4m10s`, `12s`: a short span in whole minutes and seconds.
pub fn minutes_seconds(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 60 {
        format!("{}m{}s", s / 60, s % 60)
    } else {
        format!("{s}s")
    }
}

/// Whole seconds since 1970 (0 for a time before it).
fn unix_seconds(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Year, month, day of the proleptic Gregorian calendar for days since 1970-01-01 (Howard
/// Hinnant's civil_from_days). `days` must leave room for 719,468 more.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// `HH:MM:SS` of a Unix time.
fn time_of_day(secs: u64) -> String {
    let s = secs % 86_400;
    format!("{:02}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_rfc3339_utc() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let t = UNIX_EPOCH + Duration::from_secs(951_782_400 + 3_723); // 2000-02-29 01:02:03
        assert_eq!(rfc3339(t), "2000-02-29T01:02:03Z");
        let t = UNIX_EPOCH + Duration::from_secs(1_767_225_599); // last second of 2025
        assert_eq!(rfc3339(t), "2025-12-31T23:59:59Z");
        assert_eq!(clock_utc(t), "23:59:59 UTC");
        // Before 1970 is 1970: records are never dated earlier.
        assert_eq!(
            rfc3339(UNIX_EPOCH - Duration::from_secs(1)),
            "1970-01-01T00:00:00Z"
        );
    }

    #[test]
    fn times_with_milliseconds_stay_within_what_rfc3339_can_write() {
        assert_eq!(rfc3339_millis(0, 0).unwrap(), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            rfc3339_millis(951_782_400, 7).unwrap(),
            "2000-02-29T00:00:00.007Z"
        );
        assert_eq!(
            rfc3339_millis(253_402_300_799, 999).unwrap(),
            "9999-12-31T23:59:59.999Z"
        );
        assert_eq!(rfc3339_millis(253_402_300_800, 0), None);
        assert_eq!(rfc3339_millis(i64::MAX, 0), None);
        assert_eq!(rfc3339_millis(i64::MIN, 0), None);
        assert_eq!(rfc3339_millis(-1, 0).unwrap(), "1969-12-31T23:59:59.000Z");
        assert_eq!(rfc3339_millis(0, 1000), None);
        // Both writers agree on the seconds.
        let t = UNIX_EPOCH + Duration::from_secs(1_767_225_599);
        assert_eq!(
            rfc3339_millis(1_767_225_599, 0).unwrap(),
            rfc3339(t).replace('Z', ".000Z")
        );
    }

    #[test]
    fn system_times_with_milliseconds() {
        let t = UNIX_EPOCH + Duration::from_millis(951_782_400_007);
        assert_eq!(rfc3339_millis_at(t), "2000-02-29T00:00:00.007Z");
        let before = UNIX_EPOCH - Duration::from_secs(1);
        assert_eq!(rfc3339_millis_at(before), "1970-01-01T00:00:00.000Z");
    }

    #[test]
    fn spans_are_minutes_and_seconds() {
        assert_eq!(minutes_seconds(Duration::ZERO), "0s");
        assert_eq!(minutes_seconds(Duration::from_millis(12_999)), "12s");
        assert_eq!(minutes_seconds(Duration::from_secs(60)), "1m0s");
        assert_eq!(minutes_seconds(Duration::from_secs(250)), "4m10s");
        assert_eq!(minutes_seconds(Duration::from_secs(7_200)), "120m0s");
    }
}
